"""The engine both worker pools share: paged KV memory, a scheduler and a batched model runner.

- ``engine``: ties them together: ``Engine.step()``; ``loop``: the thread that runs it and
  streams results to asyncio (``EngineLoop``).
- ``sequence``: one request's tokens and KV bookkeeping.
- ``scheduler``: which sequences run this step and how many tokens each (chunked prefill,
  continuous batching, preemption by recompute).
- ``block_manager``: KV blocks, reference counts, block tables, prefix cache.
- ``kv_cache``: the preallocated per-worker KV pool tensors, and the ``PoolMemory`` hook for
  where they live.
- ``model_runner``: packs a step's tokens into one forward; ``cuda_graphs``: decode steps on
  a GPU replayed from CUDA graphs.
- ``models``: pdserve's model code per family, by HF architecture name (``llama``, ``qwen3``,
  ``phi3``, ``moe``), over ``layers`` (embedding, linear, RMSNorm, rotary, MoE).
- ``checkpoint``: the weights read from safetensors straight into the engine's layout (or a
  loaded transformers model's).
- ``backends``: the compute backend interface and its registry (``cpu``, ``torch``, ``cuda``);
  ``cpu``: the C kernels the ``cpu`` backend calls.
- ``quantized``: a GGUF's quantized weight blocks, for linear layers that read them in place.
- ``allocator``, ``huge_pages``: a C heap that keeps freed memory between steps; CPU tensors
  on 2 MiB pages, and the run packed weights are written into at load.
"""
