"""PrefillServer: one replica of the prefill pool (a Ray Serve deployment class)."""

from __future__ import annotations

from typing import Any

from kv_transfer import make_sender
from kv_transfer.paged import PagedKVSource
from pdserve.config import ClusterConfig
from pdserve.engine.loop import EngineLoop
from pdserve.engine.sequence import Sequence
from pdserve.messages import PrefillRequest, PrefillResult
from pdserve.metrics import PoolMetrics
from pdserve.worker import build_engine

PREFILL_DEADLINE_S = 300.0  # longest a prompt may wait and run before the request fails


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class PrefillServer:
    """Prefills prompts in batches (chunked, prefix-cached), samples each first token and
    leases the prompt's KV blocks to decode.

    The KV is served from this replica's blocks by its KV server (``kv_transfer``)
    until the decode side releases it or ``prefill.kv_lease_s`` runs out.
    """

    def __init__(self, config: dict[str, Any]):
        self.cfg = ClusterConfig.from_dict(config)
        self.engine, fingerprint = build_engine(self.cfg, "prefill")
        self.loop = EngineLoop(self.engine)
        self.kv_sender = make_sender(self.cfg.kv_transfer, self.cfg.kv_transfer.bind_host or _node_ip(), fingerprint=fingerprint,
                                     block_size=self.engine.config.block_size, shm_path=self.engine.kv_cache.shm_path)
        self.num_requests = 0
        self.metrics = PoolMetrics("prefill", self.cfg.model.path, self._stats)

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Raises InvalidRequestError for a request that breaks the shared limits,
        TimeoutError after PREFILL_DEADLINE_S."""
        request.params.validate(len(request.prompt_ids), self.engine.max_model_len)
        seq = Sequence(request.request_id, list(request.prompt_ids), len(request.prompt_ids), request.params, stop_after_first_token=True)
        queue = self.loop.submit(seq)
        try:
            chunk = await self.loop.next_output(queue, PREFILL_DEADLINE_S)
        except BaseException:
            self.loop.abort(seq)
            raise
        self.num_requests += 1
        handle = None
        if chunk.finish_reason is None:  # decode will continue: lease the prompt's blocks to it
            source = PagedKVSource(self.engine.kv_cache, seq.block_table, seq.num_prompt_tokens, self.engine.free_blocks)
            handle = self.kv_sender.put(request.request_id, source, self.cfg.prefill.kv_lease_s)
        first_logprob = seq.logprobs[-1] if seq.logprobs else None
        return PrefillResult(request.request_id, seq.token_ids[-1], chunk.finish_reason, handle, first_logprob)

    async def release(self, transfer_id: str) -> bool:
        """Free a request's KV early (the router calls this when a request is cancelled)."""
        return self.kv_sender.release(transfer_id)

    async def stats(self) -> dict[str, int]:
        return self._stats()

    def _stats(self) -> dict[str, int]:
        return {"num_requests": self.num_requests, **self.engine.stats(), **self.kv_sender.stats()}

    def check_health(self) -> None:
        if not self.loop.is_alive():
            raise RuntimeError("prefill engine thread has stopped")

    def __del__(self):
        if hasattr(self, "metrics"):
            self.metrics.close()
        if hasattr(self, "kv_sender"):
            self.kv_sender.close()
        if hasattr(self, "loop"):
            self.loop.close()
        if hasattr(self, "engine"):
            self.engine.kv_cache.close()  # removes the shared-memory pool file, if any
