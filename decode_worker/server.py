"""DecodeServer: one replica of the decode pool (a Ray Serve deployment class)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from typing import Any, AsyncIterator

from kv_transfer import KVHandle, KVReceiver, make_receiver
from kv_transfer.factory import node_id
from kv_transfer.paged import PagedKVSink
from pdserve.autoscaling import BusyMeter, LatencyWindow, replica_stats
from pdserve.callers import CallerWatch
from pdserve.config import ClusterConfig
from pdserve.core_share import gate_for
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.loop import EngineLoop
from pdserve.engine.sequence import Sequence
from pdserve.errors import CapacityError, FirstTokenMissingError, KVAuthError, KVIncompatibleError, KVTransferError, PrefillEndedError
from pdserve.messages import ALL_CHOICES, ChoiceState, DecodeRequest, FreshRequest, LayerwiseKV, Migrated, TokenChunk, WithKV
from pdserve.metrics import PoolMetrics
from pdserve.replica_log import to_replica_log
from pdserve.sampling import FirstToken
from pdserve.worker import PREFILL_DEADLINE_S, build_engine, replica_name, rss_bytes

log = logging.getLogger(__name__)

STEP_DEADLINE_S = 60.0  # longest wait for one token, beyond max_step_s, before the request fails
ABORT_MEMORY_S = 300.0  # an abort by id that finds no request here is remembered this long (one that comes first)


async def receive_kv(kv_cache: PagedKVCache, receiver: KVReceiver, handle: KVHandle, blocks: list[int], num_tokens: int,
                     timeout_s: float) -> tuple[str, int | None]:
    """Fetch a prompt's KV into ``blocks`` (reserved by the caller); returns the transport
    and, for KV streamed layer-wise, prefill's first token (else None).

    Cancel-safe: if the awaiting task is cancelled, the fetch thread is told to stop and
    awaited (it stops at its next chunk or layer, or at its deadline) before the
    CancelledError goes on, so nothing writes into the blocks once the caller frees them.
    Raises what ``receiver.fetch`` raises.
    """
    cancel = threading.Event()
    sink = PagedKVSink(kv_cache, blocks, num_tokens)
    task = asyncio.ensure_future(asyncio.to_thread(receiver.fetch, handle, sink, timeout_s, cancel))
    try:
        return await asyncio.shield(task), sink.first_token
    except asyncio.CancelledError:
        cancel.set()
        with contextlib.suppress(BaseException):
            await task
        raise


def merge_chunks(a: TokenChunk, b: TokenChunk) -> TokenChunk:
    """``a`` then ``b`` as one chunk: their tokens (and logprobs) in order, ``b``'s finish reason."""
    logprobs = None if a.logprobs is None and b.logprobs is None else [*(a.logprobs or []), *(b.logprobs or [])]
    return TokenChunk([*a.token_ids, *b.token_ids], b.finish_reason, logprobs, b.index)


class DecodeServer:
    """Receives each request's prompt KV straight into its own blocks, then decodes it in
    the shared running batch (continuous batching, one forward per step).

    With ``pool="colocated"`` it is the colocated mode's only worker: requests come without
    KV, and the same engine prefills them (chunks mixed into the decode steps) and decodes.
    """

    def __init__(self, config: dict[str, Any], pool: str = "decode"):
        to_replica_log()  # this replica's INFO lines (model, weights, KV pool) in its Serve log
        self.cfg = ClusterConfig.from_dict(config)
        self.pool = pool
        self.pool_cfg = getattr(self.cfg, pool)
        self.node_id = node_id()  # Ray node id: where this replica runs (stats, placement tests)
        self.replica = replica_name()  # which replica answered a stats call
        self.engine, fingerprint = build_engine(self.cfg, pool)
        # steps wait for a prefill step on this node (decode.yield_to_prefill_s, pdserve/core_share.py; not colocated)
        self.loop = EngineLoop(self.engine, self.pool_cfg.max_step_s, self.pool_cfg.engine_nice,
                               gate_for(self.cfg.decode.yield_to_prefill_s, pool, self.node_id))
        self.kv_receiver = make_receiver(self.cfg.kv_transfer, fingerprint=fingerprint, secret=self.cfg.security.kv_secret)
        self.num_kv_fetched = 0
        self.num_kv_faults = 0  # fetches that failed; each recomputed or failed per kv_transfer.on_fault
        self.num_recomputed = 0
        self.num_migrated_in = 0  # requests resumed here after their decode replica died
        self.tpot = LatencyWindow()  # seconds per output token after the first, for autoscaling on TPOT
        self.busy = BusyMeter()  # busy fraction between autoscaling reports
        self.metrics = PoolMetrics(pool, self.cfg.model.path, self._stats, replica=self.replica)
        self._aborted: dict[str, float] = {}  # request id -> when an abort by id came (monotonic s)
        self.num_aborted_by_id = 0  # requests stopped by ``abort`` rather than by a cancelled call
        self._running: dict[str, list[Sequence]] = {}  # request id -> its sequences (n > 1: one per choice), while this replica streams it
        self.callers = CallerWatch(self._stop_orphan)  # stops the requests of a router replica that died

    async def _reserve(self, num_tokens: int, deadline: float) -> list[int]:
        """Blocks for the incoming KV; they count as used from now on, so admission sees them."""
        while True:
            # the reserve runs in a thread (it waits for the engine lock); if this request is
            # cancelled meanwhile, blocks it still takes are handed back, not lost
            call = asyncio.ensure_future(asyncio.to_thread(self.engine.reserve, num_tokens))
            try:
                blocks = await asyncio.shield(call)
            except asyncio.CancelledError:
                call.add_done_callback(self._free_reserved)
                raise
            if blocks is not None:
                return blocks
            if time.monotonic() > deadline:
                stats = self.engine.stats()
                raise CapacityError(f"decode KV pool has no room for {num_tokens} tokens after {self.pool_cfg.max_kv_wait_s:g} s "
                                    f"(decode.max_kv_wait_s; {stats.get('num_free_blocks', 0)} of {stats.get('num_blocks', 0)} blocks free, "
                                    f"{stats.get('num_running', 0)} requests running)")
            await asyncio.sleep(0.01)

    def _free_reserved(self, call: asyncio.Future) -> None:
        if not call.cancelled() and call.exception() is None and call.result():
            self.engine.free_blocks(call.result())

    async def generate(self, request: DecodeRequest) -> AsyncIterator[TokenChunk]:
        """Stream the request's tokens: after prefill's first token (WithKV, LayerwiseKV), after
        those already streamed (Migrated), or all of them (FreshRequest).

        Raises InvalidRequestError for a request over the shared limits,
        KVTransferError if the KV cannot be fetched, CapacityError if the pool has
        no room before the KV deadline, WorkerStalledError if this replica's engine is
        stuck in a step (``max_step_s``; the router migrates the request), TimeoutError
        if a token takes longer than max_step_s + STEP_DEADLINE_S.
        """
        request.params.validate(len(request.prompt_ids), self.engine.max_model_len, self.engine.vocab_size)
        if request.request_id in self._aborted:  # the router gave up on it already (abort); it releases prefill's KV
            return
        inner = self._generate(request)
        with self.callers.running(request.caller, request.request_id):  # its router dies: this task is cancelled
            try:
                async for item in inner:
                    yield item
            finally:
                await inner.aclose()  # now, not at garbage collection (see below)

    async def _generate(self, request: DecodeRequest) -> AsyncIterator[TokenChunk]:
        self.loop.raise_if_stalled()  # before fetching KV into a replica that cannot run it
        if request.params.n > 1:
            run = self._generate_choices(request)
        else:
            match request:
                case WithKV() | LayerwiseKV():
                    received = await self._receive(request)
                    if received is None:  # layer-wise: prefill finished the request itself, nothing to decode
                        return
                    seq, blocks = received
                case Migrated():
                    seq, blocks = self._migrated(request), []
                case FreshRequest():
                    seq, blocks = Sequence(request.request_id, list(request.prompt_ids), len(request.prompt_ids), request.params), []
                case _:
                    raise TypeError(f"not a decode request: {type(request).__name__}")
            if request.request_id in self._aborted:  # the router gave up on it before it got here
                self.engine.free_blocks(blocks)
                return
            run = self._run([seq], blocks)
        # Close the inner generator here, not at garbage collection: when a client leaves,
        # Ray closes this generator at its yield, and only then is the sequence aborted at once.
        try:
            async for item in run:
                yield item
        finally:
            await run.aclose()

    async def _generate_choices(self, request: DecodeRequest) -> AsyncIterator[TokenChunk]:
        """An n > 1 request (params.n): one sequence per choice still to decode, streamed with
        its index. WithKV: the prompt's KV is fetched once and its blocks forked (copy-on-write,
        Engine.fork) to each choice, which goes on after its first token; FreshRequest: the
        prompt is prefilled here once, each choice's first token drawn from its logits, then
        forked; Migrated: each choice recomputes the prompt and its streamed tokens. Choice i
        runs as the lone request with ``params.fork(i)`` would, bit for bit."""
        num_prompt, blocks, first = len(request.prompt_ids), [], []
        choices = list(request.choices)
        if isinstance(request, FreshRequest):
            first, blocks = await self._prefill_choices(request)
            if not first:  # aborted by id meanwhile
                yield TokenChunk([], "abort", index=ALL_CHOICES)
                return
            choices = [ChoiceState(c.index, (c.token_id,)) for c in first if c.finish_reason is None]
        elif isinstance(request, WithKV):
            received = await self._receive(request)
            if received is None:
                return
            blocks = received[1]
        elif isinstance(request, Migrated):
            self.num_migrated_in += 1
        else:
            raise TypeError(f"{type(request).__name__} does not take n > 1")
        tables = [[] for _ in choices]
        if blocks:  # the prompt's KV is here: fork it to every choice (frees the blocks if it fails)
            tables = await self._fork(blocks, num_prompt, len(choices))
        if request.request_id in self._aborted:  # the router gave up on it meanwhile
            for table in tables:
                self.engine.free_blocks(table)
            return
        seqs = [Sequence(request.request_id, [*request.prompt_ids, *c.streamed], num_prompt, request.params.fork(c.index),
                         num_computed_tokens=num_prompt if table else 0, block_table=table, index=c.index)
                for c, table in zip(choices, tables)]
        # the first tokens drawn here go out once the forks are queued (and own the blocks)
        firsts = [TokenChunk([] if c.finish_reason == "stop" else [c.token_id], c.finish_reason,
                             None if c.logprob is None else ([] if c.finish_reason == "stop" else [c.logprob]), c.index) for c in first]
        if not seqs:
            for chunk in firsts:
                yield chunk
            return
        run = self._run(seqs, [b for t in tables for b in t], merge=False, firsts=firsts)
        try:
            async for item in run:
                yield item
        finally:
            await run.aclose()

    async def _prefill_choices(self, request: FreshRequest) -> tuple[list[FirstToken], list[int]]:
        """Prefill an n > 1 request's prompt here and draw each choice's first token
        (Engine._sample_choices). Returns (its FirstTokens, the prompt's blocks: [] where
        every choice ended at its first token); ([], []) if it was aborted meanwhile. Its task
        cancelled (a client or router gone), the engine frees the blocks."""
        seq = Sequence(request.request_id, list(request.prompt_ids), len(request.prompt_ids), request.params, stop_after_first_token=True)
        try:
            queue = self.loop.submit(seq)
            item = await self.loop.next_output(queue, PREFILL_DEADLINE_S, f"{self.pool} prefill deadline")
        except BaseException:
            self.loop.abort(seq)  # frees blocks kept at its first token too
            raise
        if item.index == ALL_CHOICES:  # aborted by id meanwhile
            self.loop.abort(seq)
            return [], []
        blocks, seq.block_table = seq.block_table, []
        return seq.choices, blocks

    async def _fork(self, blocks: list[int], num_tokens: int, num_forks: int) -> list[list[int]]:
        """Engine.fork, waiting up to ``max_kv_wait_s`` for blocks for the copies. The caller's
        ``blocks`` pass to the tables returned; on any failure or cancel, whatever the fork holds
        is freed (CapacityError when no blocks come)."""
        deadline = time.monotonic() + self.pool_cfg.max_kv_wait_s
        while True:
            call = asyncio.ensure_future(asyncio.to_thread(self.engine.fork, blocks, num_tokens, num_forks))
            try:
                tables = await asyncio.shield(call)
                if tables is not None:
                    return tables
                if time.monotonic() > deadline:
                    raise CapacityError(f"decode KV pool has no room to fork {num_forks} choices after {self.pool_cfg.max_kv_wait_s:g} s")
                await asyncio.sleep(0.01)
            except BaseException:
                call.add_done_callback(functools.partial(self._free_fork, blocks))
                raise

    def _free_fork(self, blocks: list[int], call: asyncio.Future) -> None:
        """A fork given up: free every table it made, or the blocks where it made none."""
        tables = None if call.cancelled() or call.exception() is not None else call.result()
        for table in tables or [blocks]:
            self.engine.free_blocks(table)

    def _migrated(self, request: Migrated) -> Sequence:
        """Its replica died mid-stream: recompute the prompt and the tokens already streamed here, and go on after them."""
        self.num_migrated_in += 1
        return Sequence(request.request_id, [*request.prompt_ids, *request.streamed], len(request.prompt_ids), request.params)

    async def _receive(self, request: WithKV | LayerwiseKV) -> tuple[Sequence, list[int]] | None:
        """Reserve blocks and fetch the prompt's KV into them; on a fault, recompute or raise
        (kv_transfer.on_fault). Returns the sequence to run and the blocks it holds, or None
        when a layer-wise prefill finished the request at its first token."""
        num_prompt, timeout_s = len(request.prompt_ids), self.cfg.kv_transfer.timeout_s
        blocks = await self._reserve(num_prompt, time.monotonic() + min(timeout_s, self.pool_cfg.max_kv_wait_s))
        first_token = request.first_token if isinstance(request, WithKV) else None
        if first_token is None:  # layer-wise: the fetch also waits for prefill to compute the KV
            timeout_s += PREFILL_DEADLINE_S
        try:
            start = time.perf_counter()
            transport, streamed_first = await receive_kv(self.engine.kv_cache, self.kv_receiver, request.kv, blocks, num_prompt, timeout_s)
            first_token = first_token if first_token is not None else streamed_first
            if first_token is None:
                raise KVTransferError(f"the KV of {request.request_id} came without the first token it needs")
            self.num_kv_fetched += 1
            self.metrics.kv_transfer_seconds.observe(time.perf_counter() - start, tags={"transport": transport})
            self.metrics.kv_transfer_bytes.inc(num_prompt * self.engine.kv_spec.bytes_per_token, tags={"transport": transport})
        except PrefillEndedError:  # not a fault: the router drops this call
            self.engine.free_blocks(blocks)
            await self._release_quietly(request.kv)
            return None
        except KVTransferError as e:
            self.engine.free_blocks(blocks)
            blocks = []
            self.num_kv_faults += 1
            self.metrics.kv_transfer_faults.inc()
            await self._release_quietly(request.kv)  # the sender frees its copy now, not at lease expiry
            if isinstance(e, (KVIncompatibleError, KVAuthError)) or self.cfg.kv_transfer.on_fault == "fail":  # deployment errors are never masked
                raise
            if first_token is None:  # layer-wise, broken before prefill's token came: the router resends it with the token
                raise FirstTokenMissingError(f"KV stream for {request.request_id} broke before its first token ({e})") from None
            log.warning("KV fetch for %s failed (%s); recomputing the prompt here", request.request_id, e)
            self.num_recomputed += 1
        except BaseException:  # cancelled mid-fetch (or a bug): free both sides now
            self.engine.free_blocks(blocks)
            asyncio.get_running_loop().run_in_executor(None, self._release_sync, request.kv)
            raise
        # with its KV: decode from the first token on; without (recompute): prefill prompt + first token here
        seq = Sequence(
            request.request_id, [*request.prompt_ids, first_token], num_prompt, request.params,
            num_computed_tokens=num_prompt if blocks else 0, block_table=blocks,
        )
        return seq, blocks

    async def _run(self, seqs: list[Sequence], blocks: list[int], merge: bool = True, firsts: list[TokenChunk] = ()) -> AsyncIterator[TokenChunk]:
        """Submit one request's sequences (one, or its choices; holding ``blocks``, freed if
        they cannot be queued) and stream their tokens until each has finished, ``firsts``
        (chunks drawn before them) first. ``merge``: hold tokens up to ``stream_interval`` (one
        stream of one choice)."""
        try:
            queue = self.loop.submit_group(seqs)
        except BaseException:
            self.engine.free_blocks(blocks)
            raise
        request_id = seqs[0].request_id
        self._running[request_id] = seqs
        last, interval, num_open = None, self.pool_cfg.stream_interval, len(seqs)
        timeout_s, name = self.pool_cfg.max_step_s + STEP_DEADLINE_S, f"{self.pool} per-token deadline (max_step_s + {STEP_DEADLINE_S:g} s)"
        try:
            for chunk in firsts:
                yield chunk
            while True:
                item = await self.loop.next_output(queue, timeout_s, name)
                if item.index == ALL_CHOICES:  # aborted: ends every choice
                    yield item
                    return
                if last is not None and item.token_ids and merge:  # the first item's wait is TTFT-like: not counted
                    # hold this stream's tokens until `interval` are ready or it ends (the
                    # first item, colocated's first token, goes at once)
                    while len(item.token_ids) < interval and item.finish_reason is None:
                        item = merge_chunks(item, await self.loop.next_output(queue, timeout_s, name))
                    self.tpot.observe((time.perf_counter() - last) / len(item.token_ids))
                last = time.perf_counter()
                yield item
                num_open -= item.finish_reason is not None
                if num_open == 0:
                    return
        finally:
            self._running.pop(request_id, None)
            for seq in seqs:
                self.loop.abort(seq)  # no-op once finished

    async def abort(self, request_id: str) -> bool:
        """Stop a request by id (the router calls this for a request its client left, as Ray
        Serve's cancel of a generate call is now and then lost on the way: then the call ran on
        to max_tokens). Its stream ends with ``finish_reason="abort"`` and its blocks are freed
        before the next step. An abort that finds no such request here (not arrived yet, on
        another replica, or done) is remembered for ABORT_MEMORY_S, and a generate call for it
        that comes later returns at once. Returns whether the request was decoding here."""
        now = time.monotonic()
        for rid in [rid for rid, at in self._aborted.items() if now - at > ABORT_MEMORY_S]:
            del self._aborted[rid]
        self._aborted[request_id] = now
        if not self.loop.end_stream(request_id):  # _run yields the end and returns; its finally aborts the sequence
            return False
        self.num_aborted_by_id += 1
        return True

    def _stop_orphan(self, request_id: str) -> None:
        """Its router replica died (pdserve/callers.py): end its stream, free its blocks
        before the next step, and refuse it if its call has yet to come."""
        self._aborted[request_id] = time.monotonic()
        seqs = self._running.get(request_id)
        if seqs is not None:
            self.loop.end_stream(request_id)
            for seq in seqs:
                self.loop.abort(seq)

    async def _release_quietly(self, handle: KVHandle) -> None:
        await asyncio.to_thread(self._release_sync, handle)

    def _release_sync(self, handle: KVHandle) -> None:
        """Tell the sender to free its copy of the KV; if it cannot be reached, its lease expires."""
        try:
            self.kv_receiver.release(handle, 5.0)
        except KVTransferError:
            pass

    async def stats(self) -> dict[str, int]:
        return self._stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's hook: this replica's load, for pdserve.autoscaling.PoolAutoscaler."""
        return replica_stats(self.engine.stats(), self.tpot, "tpot", self.busy)

    def _stats(self) -> dict[str, int]:
        return {
            "num_kv_fetched": self.num_kv_fetched, "num_kv_faults": self.num_kv_faults, "num_recomputed": self.num_recomputed,
            "num_migrated_in": self.num_migrated_in, "num_aborted_by_id": self.num_aborted_by_id,
            "rss_bytes": rss_bytes(), "node_id": self.node_id, "replica": self.replica, **self.callers.stats(),
            **(self.loop.gate.stats() if self.loop.gate is not None else {}),
            **self.engine.stats(), **{f"kv_{k}": v for k, v in self.kv_receiver.stats().items()},
        }

    def check_health(self) -> None:
        """Ray Serve's health check: fails if the engine thread died or one step hangs."""
        self.loop.check_health()

    def __del__(self):
        if hasattr(self, "metrics"):
            self.metrics.close()
        if hasattr(self, "callers"):
            self.callers.close()
        if hasattr(self, "loop"):
            self.loop.close()
