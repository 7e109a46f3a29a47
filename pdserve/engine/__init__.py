"""The engine both worker pools share: paged KV memory, a scheduler and a batched model runner.

- ``block_manager``: KV blocks, reference counts, block tables, prefix cache.
- ``kv_cache``: the preallocated per-worker KV pool tensors.
- ``attention``: attention over blocks, plugged into transformers' AttentionInterface.
- ``scheduler``: which sequences run this step and how many tokens each (chunked
  prefill, continuous batching, preemption by recompute).
- ``model_runner``: packs a step's tokens into one forward.
- ``engine``: ties them together: ``Engine.step()``.
"""
