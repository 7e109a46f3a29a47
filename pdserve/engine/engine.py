"""Engine: one model, its paged KV pool, a scheduler and a runner. Both worker pools use it.

``step()`` runs one forward over everything the scheduler picked and returns the
sequences that got a new token. A prefill worker's sequences stop after their
first token and keep their blocks (``stop_after_first_token``) for the KV hand-off;
a decode worker's sequences arrive with their prompt KV already in their blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdserve.engine import backends, memory, tensor_parallel
from pdserve.engine.allocator import keep_freed_memory
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.checkpoint import Checkpoint
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.kv_cache import PagedKVCache, PoolMemory, SharedPoolMemory
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models import build_model
from pdserve.engine.sampler import Draw, sample_batch
from pdserve.errors import InvalidRequestError
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SeqStatus
from pdserve.kv_layout import KVSpec
from pdserve.sampling import FirstToken, finish_reason
from pdserve.structured import Grammars, fill_masks

log = logging.getLogger(__name__)

MASK_DEADLINE_S = 30.0  # longest a step waits for its grammar masks (a few us to ms each) before it fails


@dataclass
class EngineConfig:
    # KV blocks in the pool; 0 on a GPU: sized by memory, ``kv_cache_memory_fraction`` of what
    # is free after the weights and a profiled step at the largest batch (memory.py)
    num_blocks: int
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # sequences per forward
    max_num_batched_tokens: int = 2048  # new tokens per forward
    chunk_size: int = 2048  # prompt tokens of one sequence per forward (chunked prefill)
    enable_prefix_caching: bool = True
    # CPU: a C heap that keeps freed memory (allocator.py); GPU: CUDA graphs for decode
    # (cuda_graphs). False = malloc defaults, eager GPU steps
    optimize: bool = True
    # the compute backend (engine/backends/): "cpu" (pdserve's C kernels, batch invariant),
    # "torch" (portable, batch invariant row by row, slow), "cuda" (a GPU), or "auto": cuda on
    # a GPU, else cpu where its kernels build and pass their self-check, else torch
    backend: str = "auto"
    # decode steps replayed from CUDA graphs (cuda_graphs.py; takes the pool's last block as
    # padding scratch). None = on where the model is on a GPU and ``optimize`` is on. True on
    # the CPU runs the same padded static-shape steps eagerly (what the CPU tests check).
    cuda_graphs: bool | None = None
    # ranks that split the model's heads and feed-forward (tensor_parallel/): rank 0 here, the
    # others Ray actors in this actor's placement group, else child processes; one node, CPU only
    tensor_parallel_size: int = 1
    kv_cache_memory_fraction: float = 0.9  # with num_blocks 0 (memory.py)


class Engine:
    def __init__(self, model, config: EngineConfig, eos_token_ids: frozenset[int], max_model_len: int,
                 kv_memory: PoolMemory | None = None, quantized: dict | None = None, grammars: Grammars | None = None):
        """``model``: a Checkpoint (engine/checkpoint.py) or a loaded transformers model; the
        engine runs where it is (CPU or a CUDA device). ``kv_memory``: where the
        KV pool lives (engine/kv_cache.py's PoolMemory: private memory by default; the KV
        transfer provides ones a same-node peer can map); ``quantized``: the
        model's weights in GGUF blocks by parameter name (engine/quantized.py), for linear
        layers that read them in place where the backend can (the same bits as dense);
        ``grammars``: the tokenizer's grammar cache for structured output (pdserve/structured.py),
        None for an engine that serves none."""
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        model = Checkpoint.of(model)
        self.vocab_size = model.config.vocab_size  # logits per row
        self.kv_spec = KVSpec.from_model_config(model.config, model.dtype)
        tp = config.tensor_parallel_size
        self._own_memory = None  # a shared pool made here for tensor-parallel ranks (closed by ``close``)
        if tp > 1:
            kv_memory = self._tensor_parallel_pool(model, kv_memory)
        sized_by_memory = config.num_blocks == 0
        if sized_by_memory and (model.device.type != "cuda" or tp > 1):
            raise ValueError(f"a KV pool sized by memory (num_blocks 0) needs the model on one GPU, not {model.device} at TP {tp}")
        # sized by memory: a pool for the profiled step first, the sized one once the model is built
        first_pool = (memory.profile_blocks(config), None) if sized_by_memory else (config.num_blocks, kv_memory)
        self.kv_cache = PagedKVCache(self.kv_spec, first_pool[0], config.block_size, model.device, first_pool[1])
        device = self.kv_cache.device
        use_graphs = config.cuda_graphs if config.cuda_graphs is not None else (config.optimize and device.type == "cuda")
        self.tp = None  # the tensor-parallel group (ranks 1 ..), or None on one rank
        threads = torch.get_num_threads() if device.type == "cpu" else 1
        if tp > 1:
            if quantized:
                log.info("tensor parallel: dense weights (GGUF blocks are read whole, not split)")
            try:
                self.tp, self.model = tensor_parallel.start(model, self.kv_cache, tp, config.backend, threads, max_model_len,
                                                            max(config.max_num_batched_tokens, config.chunk_size), config.max_num_seqs)
            except BaseException:
                self.close()
                raise
            self.backend = self.model.backend
        else:
            self.backend = backends.select(config.backend, self.kv_cache, threads)
            self.model = build_model(model, self.backend, max_model_len, quantized)  # raises UnsupportedModelError
        if sized_by_memory:
            config = self.config = self._size_pool(config, max_model_len, kv_memory, use_graphs)
        if use_graphs and config.num_blocks < 2:
            raise ValueError("CUDA graphs take one KV block as scratch: the pool needs at least 2 blocks")
        num_usable_blocks = config.num_blocks - 1 if use_graphs else config.num_blocks  # the last block is the graphs' scratch
        self.block_manager = BlockManager(num_usable_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.chunk_size)
        if config.optimize and device.type == "cpu":
            keep_freed_memory()
        graphs = None
        if use_graphs and getattr(self.model, "no_graphs", None):  # Python over the step's lists: a graph would freeze them
            log.info("decode steps run eagerly, not from CUDA graphs: %s", "; ".join(self.model.no_graphs))
            use_graphs = False
        if use_graphs:
            graphs = DecodeGraphs(self.model, self.kv_cache, config.num_blocks - 1, config.max_num_seqs, max_model_len, capture=device.type == "cuda")
            graphs.capture_all()  # now, not while serving
        self.runner = ModelRunner(self.model, self.backend, graphs, self.tp)
        self.grammars = grammars
        self._masks: ThreadPoolExecutor | None = None  # fills grammar masks while a forward runs (started on first use)
        self.lock = threading.RLock()  # guards the scheduler and block manager
        self.num_steps = 0
        self.num_tokens_computed = 0
        self.busy_s = 0.0  # seconds spent in steps that ran a batch (autoscaling's busy fraction)
        self._publish_stats()

    def _size_pool(self, config: EngineConfig, max_model_len: int, kv_memory: PoolMemory | None, use_graphs: bool) -> EngineConfig:
        """Profile the largest step over the small first pool, free it, and allocate the pool
        ``memory.kv_blocks_for_memory`` gives (in ``kv_memory`` where given); returns the
        config with its block count. Raises ValueError, in one line, where that pool cannot
        hold one request of ``max_model_len`` tokens."""
        device = self.kv_cache.device
        peak = memory.profile_step_peak(self.model, self.backend, config)
        self.kv_cache = self.backend.kv_cache = None
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0]
        bytes_per_block = self.kv_spec.bytes_per_token * config.block_size
        num_blocks = memory.kv_blocks_for_memory(free, peak, config.kv_cache_memory_fraction, bytes_per_block)
        usable = num_blocks - 1 if use_graphs else num_blocks  # (the graphs' scratch block)
        if usable * config.block_size < max_model_len:
            raise ValueError(
                f"the KV pool would hold {max(0, usable) * config.block_size} tokens ({config.kv_cache_memory_fraction} of the "
                f"{free / 2**30:.2f} GiB free on {device} after the weights, less a {peak / 2**30:.2f} GiB step), less than one "
                f"request of {max_model_len} tokens: raise kv_cache_memory_fraction, lower model.max_model_len or max_num_batched_tokens")
        self.kv_cache = self.backend.kv_cache = PagedKVCache(self.kv_spec, num_blocks, config.block_size, device, kv_memory)
        log.info("KV pool sized by memory: %d blocks (%d tokens, %.2f GiB) = %.2f of %.2f GiB free after the weights, less a "
                 "%.2f GiB profiled step", num_blocks, num_blocks * config.block_size, self.kv_cache.nbytes / 2**30,
                 config.kv_cache_memory_fraction, free / 2**30, peak / 2**30)
        return dataclasses.replace(config, num_blocks=num_blocks)

    def _tensor_parallel_pool(self, model: Checkpoint, kv_memory: PoolMemory | None) -> PoolMemory:
        """The memory of a pool every rank maps: ``kv_memory`` where it is a shared file, else
        one made here. Raises ValueError for a GPU model or a pool that cannot be shared."""
        if model.device.type != "cpu":
            raise ValueError("tensor_parallel_size > 1 runs on CPU ranks; a GPU model runs on one device")
        if self.config.cuda_graphs:
            raise ValueError("tensor_parallel_size > 1 runs its steps eagerly: cuda_graphs must be off")
        if kv_memory is not None and kv_memory.shm_path is not None:
            return kv_memory
        if kv_memory is not None and type(kv_memory) is not PoolMemory:
            raise ValueError(f"tensor_parallel_size > 1 needs a KV pool its ranks can map, not {type(kv_memory).__name__}")
        path = f"/dev/shm/pdserve-tp-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._own_memory = SharedPoolMemory(path, self.kv_spec, self.config.num_blocks, self.config.block_size)
        return self._own_memory

    def close(self) -> None:
        """Stop the tensor-parallel ranks and remove a shared pool made here (idempotent)."""
        if getattr(self, "tp", None) is not None:
            self.tp.close()
            self.tp = None
        if self._own_memory is not None:
            self._own_memory.close()
            self._own_memory = None

    def check_health(self) -> None:
        """Raises RuntimeError where a tensor-parallel rank died or failed."""
        if self.tp is not None:
            self.tp.check()

    def check_fits(self, seq: Sequence) -> None:
        """Raises InvalidRequestError if ``seq`` could never fit in the KV pool (no lock taken)."""
        max_tokens = seq.num_prompt_tokens + seq.params.max_tokens
        if self.block_manager.num_blocks_for(max_tokens) > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"{max_tokens} tokens (prompt + max_tokens) exceed this worker's KV pool of "
                f"{self.block_manager.num_blocks * self.config.block_size} tokens"
            )

    def prepare(self, seq: Sequence) -> None:
        """Build ``seq``'s grammar matcher where it has ``params.structured``, having it accept
        the tokens generated so far (after prefill's first token, a migration or a recompute),
        so that its next token is sampled as in one process. Compiles the grammar on a cache
        miss (about 1 ms for a JSON schema): call it off the step thread, as EngineLoop.submit
        does (``add`` calls it too, where it has not run). No lock taken. Raises
        InvalidRequestError for an engine without ``grammars``, a grammar that does not
        compile, or tokens it does not accept."""
        if seq.params.structured is None or seq.grammar is not None:
            return
        if self.grammars is None:
            raise InvalidRequestError("this engine was built without its tokenizer's grammars: it serves no structured output")
        seq.grammar = self.grammars.matcher(seq.params.structured, seq.token_ids[seq.num_prompt_tokens:])

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (waits for a running step). Raises InvalidRequestError if it could
        never fit in the KV pool, or for its structured output (``prepare``)."""
        self.check_fits(seq)
        self.prepare(seq)
        with self.lock:
            self.switch_rope_tables([seq])
            self.scheduler.add(seq)
            self._publish_stats()

    def reserve(self, num_tokens: int) -> list[int] | None:
        """Take blocks for ``num_tokens`` incoming tokens (KV in flight); None if the pool is short."""
        with self.lock:
            num_blocks = self.block_manager.num_blocks_for(num_tokens)
            if not self.block_manager.can_allocate(num_blocks):
                return None
            blocks = self.block_manager.allocate_blocks(num_blocks)
            self._publish_stats()
            return blocks

    def fork(self, block_table: list[int], num_tokens: int, num_forks: int) -> list[list[int]] | None:
        """``num_forks`` block tables over the KV of ``num_tokens`` tokens in ``block_table``
        (an n > 1 request's prompt): the first is ``block_table``; the others share its full
        blocks and own a copy of its partly filled last one (BlockManager.fork). None, with
        nothing taken, if the pool has too few free blocks for the copies."""
        with self.lock:
            forked = self.block_manager.fork(block_table, num_tokens, num_forks)
            if forked is None:
                return None
            tables, copies = forked
            self.kv_cache.copy_blocks(copies)
            self._publish_stats()
            return tables

    def free_blocks(self, block_ids: list[int]) -> None:
        with self.lock:
            self.block_manager.free_blocks(block_ids)
            self._publish_stats()

    def abort(self, seq: Sequence) -> None:
        with self.lock:
            self.scheduler.finish(seq)
            self._publish_stats()

    def step(self) -> list[Sequence]:
        """One forward. Returns the sequences that got a new token (``token_ids[-1]``);
        a finished one has ``finish_reason`` set and is out of the scheduler."""
        with self.lock, self.backend.step_scope():
            try:
                return self._step()
            finally:
                self._publish_stats()

    LONG_ROPE_SALT = b"longrope:long"

    def switch_rope_tables(self, seqs: list[Sequence]) -> None:
        """longrope (layers/rotary.py LongRopeRotary): a sequence longer than the original
        context has all its KV on the long table, salted apart in the prefix cache; one whose
        KV was computed on the short table (its prompt no longer than that) and that has just
        grown past it is preempted, to recompute every token on the long one, as Phi-3's
        ``generate`` recomputes its cache at that step. With ``self.lock`` held."""
        original = getattr(self.model, "rope_switch", None)
        if original is None:
            return
        for seq in seqs:
            if seq.kv_salt is None and seq.num_tokens > original:
                seq.kv_salt = self.LONG_ROPE_SALT
                if seq.num_computed_tokens > 0 and seq.num_prompt_tokens <= original:  # its KV is on the short table
                    if seq.status is SeqStatus.RUNNING:
                        self.scheduler.preempt(seq)
                    else:  # KV handed over with it (a prompt of `original` tokens and its first token): not kept
                        self.block_manager.free(seq)

    def free_outside_window(self) -> None:
        """Where every layer has the same sliding window W (model ``kv_window``): a running
        sequence's next token, at position c = its computed tokens, and every later one, see
        keys from c - W + 1 on, so the blocks wholly before that go back to the pool (their ids
        stay in the table: the kernels read only inside a row's window, or mask what they read
        of its first tile, and a block's KV is finite whatever holds it now). Not for a
        sequence kept for a hand-off, whose whole prompt goes to decode; the block before the
        one being filled is kept (its hash chains the prefix cache). With ``self.lock`` held."""
        window = getattr(self.model, "kv_window", None)
        if window is None:
            return
        bs = self.block_manager.block_size
        for seq in self.scheduler.running:
            if not seq.stop_after_first_token and seq.params.n == 1:  # (n > 1: the blocks are forked at the first token)
                c = seq.num_computed_tokens
                self.block_manager.free_leading(seq, min(max(0, c - window + 1) // bs, c // bs - 1))

    def _step(self) -> list[Sequence]:
        """``step`` with ``self.lock`` held."""
        self.switch_rope_tables(list(self.scheduler.running))
        self.free_outside_window()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        start = time.perf_counter()
        # the grammar masks of the rows that sample this step, filled while the forward runs
        constrained = [seq for seq, num_new in batch if seq.grammar is not None and seq.num_uncomputed_tokens == num_new]
        if constrained:
            self._masks = self._masks or ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
            masks_done = self._masks.submit(fill_masks, [seq.grammar for seq in constrained], self.vocab_size)
        logits = self.runner.forward(batch)  # [len(batch), vocab]
        masks = dict(zip(map(id, constrained), masks_done.result(timeout=MASK_DEADLINE_S))) if constrained else {}  # [words] int32 each
        self.num_steps += 1
        finished, draws = [], []  # sequences that sample this step; one Draw per token to pick
        for r, (seq, num_new) in enumerate(batch):
            computed_before = seq.num_computed_tokens
            seq.num_computed_tokens += num_new
            self.num_tokens_computed += num_new
            self.block_manager.mark_computed(seq, computed_before)
            if seq.num_uncomputed_tokens > 0:  # a prompt chunk; more to come
                continue
            finished.append((seq, len(draws)))
            mask = masks.get(id(seq))  # disallowed tokens at -inf: in the draw and in the logprobs, as vLLM masks them
            for i in range(seq.params.n):  # n > 1: every choice's first token, drawn as its fork alone would be
                draws.append(Draw(r, seq.params.fork(i), seq.num_tokens, seq.num_generated, seq.token_ids, seq.num_prompt_tokens, mask))
        sampled = sample_batch(logits, draws, self.eos_token_ids, getattr(self.backend, "mask_logits_", None))  # on the logits' device
        outputs = []
        for seq, first in finished:
            if seq.params.n > 1:  # its worker forks the blocks or hands them off
                self._take_choices(seq, sampled.token_ids[first : first + seq.params.n], sampled.logprobs[first : first + seq.params.n])
                outputs.append(seq)
                continue
            token = sampled.token_ids[first]
            seq.token_ids.append(token)
            if seq.params.logprobs is not None:
                seq.logprobs.append(sampled.logprobs[first])
            seq.finish_reason = finish_reason(token, seq.num_generated, seq.params, self.eos_token_ids)
            if seq.grammar is not None:
                if not seq.grammar.consume_token(token):
                    raise RuntimeError(f"{seq.request_id}: token {token} was sampled under its grammar's mask and refused by it: {seq.grammar.get_error()}")
                if seq.finish_reason is None and seq.grammar.is_stopped() and token in self.eos_token_ids:
                    seq.finish_reason = "stop"  # its grammar has ended (with ignore_eos, or before min_tokens)
            if seq.finish_reason is not None:
                if seq.kv_progress is not None:  # layer-wise: its reader stops, with no fault
                    seq.kv_progress.end()
                self.scheduler.finish(seq)
            elif seq.stop_after_first_token:  # prefill: the KV goes to decode
                self.scheduler.finish(seq, free_blocks=False)
                if seq.kv_progress is not None:  # layer-wise: the stream's last message can go now
                    seq.kv_progress.finish(token)
            outputs.append(seq)
        self.busy_s += time.perf_counter() - start
        return outputs

    def _take_choices(self, seq: Sequence, tokens: list[int], logprobs: list) -> None:
        """``seq`` (params.n > 1, its prompt computed) gets its n choices' first tokens
        (``tokens``, each drawn as the lone request with ``params.fork(i)`` would draw it, and
        their ``logprobs``) in ``seq.choices``, and stops there: its blocks kept while a choice
        goes on (``finish_reason`` None), freed when each has ended (choice 0's reason).
        Choice 0's token and logprob are its own. Raises ValueError for a sequence that would
        go on decoding in this engine: n > 1 is forked by a worker (``fork``), not here."""
        if not seq.stop_after_first_token or seq.num_generated:
            raise ValueError(f"{seq.request_id}: n > 1 stops at its first tokens, for its worker to fork")
        seq.choices = []
        for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
            params = seq.params.fork(i)
            reason = finish_reason(token, 1, params, self.eos_token_ids)
            if reason is None and seq.grammar is not None and token in self.eos_token_ids:
                reason = "stop"  # the mask allowed EOS: the grammar has ended (as consume_token + is_stopped finds)
            seq.choices.append(FirstToken(i, token, reason, logprob))
        first = seq.choices[0]
        seq.token_ids.append(first.token_id)
        if first.logprob is not None:
            seq.logprobs.append(first.logprob)
        ended = all(c.finish_reason is not None for c in seq.choices)
        seq.finish_reason = first.finish_reason if ended else None
        self.scheduler.finish(seq, free_blocks=ended)
        if seq.kv_progress is not None and ended:
            seq.kv_progress.end()
        elif seq.kv_progress is not None:
            seq.kv_progress.finish(first.token_id)

    def stats(self) -> dict[str, float]:
        """Counters as of the last change (step, add, reserve, free, abort). Lock-free: a busy
        engine thread holds the lock nearly all the time, and monitoring must not wait on it."""
        return dict(self._stats)

    def _publish_stats(self) -> None:
        """Refresh the ``stats()`` snapshot; called with ``self.lock`` held, after every change."""
        self._stats = {
            **self.block_manager.usage(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            # tokens still to compute: queued prompt tokens in a prefill pool, ~1 per request in decode
            "num_uncomputed_tokens": sum(seq.num_uncomputed_tokens for seq in (*self.scheduler.waiting, *self.scheduler.running)),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_tokens_computed": self.num_tokens_computed,
            "busy_s": self.busy_s,
        }
