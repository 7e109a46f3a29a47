"""PrefillServer: one replica of the prefill pool (a Ray Serve deployment class)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kv_transfer import make_sender
from pdserve.config import ClusterConfig
from pdserve.messages import PrefillRequest, PrefillResult
from pdserve.sampling import finish_reason, sample
from pdserve.worker import build_runner


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class PrefillServer:
    """Runs each prompt forward, samples its first token and leases its KV to decode.

    The KV is served by this replica's KV server (``kv_transfer``) until the
    decode side releases it or ``prefill.kv_lease_s`` runs out.
    """

    def __init__(self, config: dict[str, Any]):
        self.cfg = ClusterConfig.from_dict(config)
        self.runner = build_runner(self.cfg)
        self.kv_sender = make_sender(self.cfg.kv_transfer, _node_ip())
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")
        self.num_requests = 0

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Raises InvalidRequestError for a request that breaks the shared limits."""
        params = request.params
        params.validate(len(request.prompt_ids), self.runner.max_model_len)
        start = time.perf_counter()
        logits, kv = await asyncio.get_running_loop().run_in_executor(
            self._executor, self.runner.prefill, request.prompt_ids
        )
        prefill_s = time.perf_counter() - start
        self.num_requests += 1
        token = sample(logits, params, position=len(request.prompt_ids))
        reason = finish_reason(token, 1, params, self.runner.eos_token_ids)
        handle = None
        if reason is None:  # decode will continue: lease the KV to it
            handle = self.kv_sender.put(request.request_id, kv, self.cfg.prefill.kv_lease_s)
        return PrefillResult(request.request_id, token, reason, handle, prefill_s)

    async def release(self, transfer_id: str) -> bool:
        """Free a request's KV early (the router calls this when a request is cancelled)."""
        return self.kv_sender.release(transfer_id)

    async def stats(self) -> dict[str, int]:
        return {"num_requests": self.num_requests, "num_forwards": self.runner.num_forwards, **self.kv_sender.stats()}

    def check_health(self) -> None:
        pass

    def __del__(self):
        if hasattr(self, "kv_sender"):
            self.kv_sender.close()
