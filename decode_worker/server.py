"""DecodeServer: one replica of the decode pool (a Ray Serve deployment class)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from decode_worker.engine import DecodeEngine
from kv_transfer import make_receiver
from pdserve.config import ClusterConfig
from pdserve.errors import KVTransferError
from pdserve.messages import DecodeRequest, TokenChunk
from pdserve.worker import build_runner

log = logging.getLogger(__name__)

STEP_DEADLINE_S = 60.0  # longest wait for one token before the request fails


class DecodeServer:
    """Fetches each request's prompt KV, acknowledges it and decodes in the DecodeEngine."""

    def __init__(self, config: dict[str, Any]):
        self.cfg = ClusterConfig.from_dict(config)
        self.runner = build_runner(self.cfg)
        self.kv_receiver = make_receiver(self.cfg.kv_transfer, self.runner.kv_spec)
        self.engine = DecodeEngine(self.runner)
        self.num_kv_fetched = 0

    async def generate(self, request: DecodeRequest) -> AsyncIterator[TokenChunk]:
        """Stream the tokens after ``request.first_token``.

        Raises InvalidRequestError for a request over the shared limits,
        KVTransferError if the KV cannot be fetched, TimeoutError if a token
        takes longer than STEP_DEADLINE_S.
        """
        request.params.validate(len(request.prompt_ids), self.runner.max_model_len)
        timeout_s = self.cfg.kv_transfer.timeout_s
        kv = await asyncio.to_thread(self.kv_receiver.fetch, request.kv, timeout_s)
        self.num_kv_fetched += 1
        try:
            await asyncio.to_thread(self.kv_receiver.release, request.kv, timeout_s)
        except KVTransferError:  # the lease will expire on its own
            log.warning("could not release KV %s; its lease will expire", request.kv.transfer_id)
        out = self.engine.add(request.request_id, request.params, request.first_token, kv)
        try:
            while True:
                item = await asyncio.wait_for(out.get(), timeout=STEP_DEADLINE_S)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.engine.abort(request.request_id)  # no-op once finished

    async def stats(self) -> dict[str, int]:
        return {"num_kv_fetched": self.num_kv_fetched, **self.engine.stats()}

    def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError("decode engine thread has stopped")

    def __del__(self):
        if hasattr(self, "engine"):
            self.engine.close()
