"""PrefillServer: one replica of the prefill pool (a Ray Serve deployment class)."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, AsyncIterator

from kv_transfer import make_sender
from kv_transfer.factory import node_id, prefill_pool_memory
from kv_transfer.paged import PagedKVSource
from kv_transfer.progress import LayerProgress, StreamedKVSource
from pdserve.autoscaling import BusyMeter, LatencyWindow, replica_stats
from pdserve.callers import CallerWatch
from pdserve.config import ClusterConfig
from pdserve.core_share import gate_for
from pdserve.engine.loop import EngineLoop
from pdserve.engine.sequence import Sequence
from pdserve.messages import PrefillRequest, PrefillResult, PrefillStarted
from pdserve.metrics import PoolMetrics
from pdserve.replica_log import to_replica_log
from pdserve.worker import PREFILL_DEADLINE_S, build_engine, replica_name, rss_bytes



def kv_bind_host() -> str:
    """Where this replica's KV server listens when ``kv_transfer.bind_host`` is null: loopback
    while the Ray cluster has a single node (every pool is on it), this node's address once
    pools can span nodes. Checked as the replica starts."""
    import ray

    if ray.is_initialized() and sum(1 for n in ray.nodes() if n.get("Alive")) > 1:
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


class PrefillServer:
    """Prefills prompts in batches (chunked, prefix-cached), samples each first token and
    leases the prompt's KV blocks to decode.

    The KV is served from this replica's blocks by its KV server (``kv_transfer``)
    until the decode side releases it or ``prefill.kv_lease_s`` runs out.
    """

    def __init__(self, config: dict[str, Any]):
        to_replica_log()  # this replica's INFO lines (model, weights, KV pool) in its Serve log
        self.cfg = ClusterConfig.from_dict(config)
        self.pool_cfg = self.cfg.prefill
        self.node_id = node_id()  # Ray node id: where this replica runs (stats, placement tests)
        self.replica = replica_name()  # which replica answered a stats call (prefix-routing tests)
        # its KV pool where a same-node decode worker can read it (shm, cuda_ipc)
        self.engine, fingerprint = build_engine(self.cfg, "prefill", kv_memory=functools.partial(prefill_pool_memory, self.cfg.kv_transfer))
        # this engine and decode's on this node take turns (decode.yield_to_prefill_s, pdserve/core_share.py)
        self.loop = EngineLoop(self.engine, self.pool_cfg.max_step_s, self.pool_cfg.engine_nice,
                               gate_for(self.cfg.decode.yield_to_prefill_s, "prefill", self.node_id))
        self.kv_sender = make_sender(self.cfg.kv_transfer, self.cfg.kv_transfer.bind_host or kv_bind_host(), fingerprint=fingerprint,
                                     block_size=self.engine.config.block_size, shm_path=self.engine.kv_cache.shm_path,
                                     cuda_ipc=self.engine.kv_cache.ipc_handles is not None,
                                     secret=self.cfg.security.kv_secret)
        self.num_requests = 0
        self.ttft = LatencyWindow()  # seconds from arrival to first token, for autoscaling on TTFT
        self.busy = BusyMeter()  # busy fraction between autoscaling reports
        self.metrics = PoolMetrics("prefill", self.cfg.model.path, self._stats, replica=self.replica)
        # a router replica that dies: its prefills are cancelled and the KV leased for it released
        self.callers = CallerWatch(self.kv_sender.release)

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Raises InvalidRequestError for a request that breaks the shared limits,
        WorkerStalledError if this replica's engine is stuck in a step (the router sends
        the request to another replica), TimeoutError after PREFILL_DEADLINE_S."""
        start, seq = time.perf_counter(), self._sequence(request)
        with self.callers.running(request.caller, request.request_id):  # its router dies: cancelled
            queue = self.loop.submit(seq)
            try:
                chunk = await self.loop.next_output(queue, PREFILL_DEADLINE_S, "prefill deadline (queue and prefill of the prompt)")
            except BaseException:
                self.loop.abort(seq)
                raise
        handle = None
        if chunk.finish_reason is None:  # decode will continue: lease the prompt's blocks to it
            source = PagedKVSource(self.engine.kv_cache, seq.block_table, seq.num_prompt_tokens, self.engine.free_blocks)
            handle = self.kv_sender.put(request.request_id, source, self.pool_cfg.kv_lease_s)
            self.callers.hold(request.caller, request.request_id, self.pool_cfg.kv_lease_s)  # its router dies: released
        return self._result(seq, chunk.finish_reason, handle, start)

    def _sequence(self, request: PrefillRequest) -> Sequence:
        """Raises InvalidRequestError for a request that breaks the shared limits."""
        request.params.validate(len(request.prompt_ids), self.engine.max_model_len, self.engine.vocab_size)
        return Sequence(request.request_id, list(request.prompt_ids), len(request.prompt_ids), request.params, stop_after_first_token=True)

    def _result(self, seq: Sequence, finish_reason: str | None, handle, start: float) -> PrefillResult:
        """The reply for a prefilled ``seq``, counted (``start``: its time.perf_counter() on arrival)."""
        self.num_requests += 1
        self.ttft.observe(time.perf_counter() - start)
        first_logprob = seq.logprobs[-1] if seq.logprobs else None
        return PrefillResult(seq.request_id, seq.token_ids[-1], finish_reason, handle, first_logprob, tuple(seq.choices or ()))

    async def prefill_layerwise(self, request: PrefillRequest) -> AsyncIterator[PrefillStarted | PrefillResult]:
        """Layer-wise hand-off (``kv_transfer.layerwise``): yields PrefillStarted once the prompt
        is scheduled (its KV leased as it is computed: each layer can be fetched as soon as it
        is written, kv_transfer/progress.py), then the PrefillResult.

        The blocks stay the engine's until prefill ends, then pass to the lease (``own``).
        Raises as ``prefill``; on any error or cancel the lease ends and the engine frees them.
        """
        start, seq = time.perf_counter(), self._sequence(request)
        loop, started = asyncio.get_running_loop(), asyncio.Event()
        seq.kv_progress = progress = LayerProgress(self.engine.kv_spec.num_layers, seq.num_prompt_tokens,
                                                   on_start=lambda: loop.call_soon_threadsafe(started.set))
        source = StreamedKVSource(self.engine.kv_cache, seq, self.engine.free_blocks, progress)
        output = None
        with self.callers.running(request.caller, request.request_id):  # its router dies: this task is cancelled
            handle = self.kv_sender.put(request.request_id, source, PREFILL_DEADLINE_S + self.pool_cfg.kv_lease_s)
            try:
                queue = self.loop.submit(seq)
                output = asyncio.ensure_future(self.loop.next_output(queue, PREFILL_DEADLINE_S, "prefill deadline (queue and prefill of the prompt)"))
                waiter = asyncio.ensure_future(started.wait())
                await asyncio.wait([output, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if not output.done():  # scheduled, computing: decode may start fetching
                    yield PrefillStarted(request.request_id, handle)
                chunk = await output
            except BaseException:
                progress.fail("prefill failed or was cancelled")
                if output is not None:
                    output.cancel()
                self.kv_sender.release(request.request_id)  # not yet the lease's blocks: nothing freed here ...
                self.loop.abort(seq)  # ... the engine frees them
                raise
        if chunk.finish_reason is not None:  # done at the first token: the engine freed the blocks
            self.kv_sender.release(request.request_id)
            handle = None
        elif source.own():  # the blocks are the lease's now; its clock starts as for a finished prefill
            self.kv_sender.table.renew(request.request_id, self.pool_cfg.kv_lease_s)
            self.callers.hold(request.caller, request.request_id, self.pool_cfg.kv_lease_s)
        else:  # decode already gave up on this KV (its lease ended): free the blocks here
            self.engine.free_blocks(seq.block_table)
        yield self._result(seq, chunk.finish_reason, handle, start)

    async def release(self, transfer_id: str) -> bool:
        """Free a request's KV early (the router calls this when a request is cancelled)."""
        return self.kv_sender.release(transfer_id)

    async def stats(self) -> dict[str, int]:
        return self._stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's hook: this replica's load, for pdserve.autoscaling.PoolAutoscaler."""
        return replica_stats(self.engine.stats(), self.ttft, "ttft", self.busy)

    def _stats(self) -> dict[str, int]:
        return {"num_requests": self.num_requests, "rss_bytes": rss_bytes(), "node_id": self.node_id, "replica": self.replica, **self.callers.stats(),
                "kv_address": getattr(self.kv_sender, "address", ""), **self.engine.stats(), **self.kv_sender.stats(),
                **(self.loop.gate.stats() if self.loop.gate is not None else {})}

    def check_health(self) -> None:
        """Ray Serve's health check: fails if the engine thread died or one step hangs."""
        self.loop.check_health()

    def __del__(self):
        if hasattr(self, "metrics"):
            self.metrics.close()
        if hasattr(self, "callers"):
            self.callers.close()
        if hasattr(self, "kv_sender"):
            self.kv_sender.close()
        if hasattr(self, "loop"):
            self.loop.close()
        if hasattr(self, "engine"):
            self.engine.kv_cache.close()  # removes the shared-memory pool file, if any
