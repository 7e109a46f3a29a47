"""DecodeServer: one replica of the decode pool (a Ray Serve deployment class)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from kv_transfer import make_receiver
from kv_transfer.paged import PagedKVSink
from pdserve.config import ClusterConfig
from pdserve.engine.loop import EngineLoop
from pdserve.engine.sequence import Sequence
from pdserve.errors import CapacityError, KVTransferError
from pdserve.messages import DecodeRequest, TokenChunk
from pdserve.worker import build_engine

log = logging.getLogger(__name__)

STEP_DEADLINE_S = 60.0  # longest wait for one token before the request fails


class DecodeServer:
    """Receives each request's prompt KV straight into its own blocks, then decodes it in
    the shared running batch (continuous batching, one forward per step)."""

    def __init__(self, config: dict[str, Any]):
        self.cfg = ClusterConfig.from_dict(config)
        self.engine = build_engine(self.cfg, "decode")
        self.loop = EngineLoop(self.engine)
        self.kv_receiver = make_receiver(self.cfg.kv_transfer)
        self.num_kv_fetched = 0

    async def _reserve(self, num_tokens: int, deadline: float) -> list[int]:
        """Blocks for the incoming KV; they count as used from now on, so admission sees them."""
        while True:
            blocks = await asyncio.to_thread(self.engine.reserve, num_tokens)
            if blocks is not None:
                return blocks
            if time.monotonic() > deadline:
                raise CapacityError(f"decode KV pool has no room for {num_tokens} tokens")
            await asyncio.sleep(0.01)

    async def generate(self, request: DecodeRequest) -> AsyncIterator[TokenChunk]:
        """Stream the tokens after ``request.first_token``.

        Raises InvalidRequestError for a request over the shared limits,
        KVTransferError if the KV cannot be fetched, CapacityError if the pool has
        no room before the KV deadline, TimeoutError if a token takes longer than
        STEP_DEADLINE_S.
        """
        request.params.validate(len(request.prompt_ids), self.engine.max_model_len)
        timeout_s = self.cfg.kv_transfer.timeout_s
        num_prompt = len(request.prompt_ids)
        blocks = await self._reserve(num_prompt, time.monotonic() + timeout_s)
        try:
            sink = PagedKVSink(self.engine.kv_cache, blocks, num_prompt)
            await asyncio.to_thread(self.kv_receiver.fetch, request.kv, sink, timeout_s)
        except BaseException:
            self.engine.free_blocks(blocks)
            raise
        self.num_kv_fetched += 1
        try:
            await asyncio.to_thread(self.kv_receiver.release, request.kv, timeout_s)
        except KVTransferError:  # the lease will expire on its own
            log.warning("could not release KV %s; its lease will expire", request.kv.transfer_id)
        seq = Sequence(
            request.request_id, [*request.prompt_ids, request.first_token], num_prompt, request.params,
            num_computed_tokens=num_prompt, block_table=blocks,
        )
        try:
            queue = self.loop.submit(seq)
        except BaseException:
            self.engine.free_blocks(blocks)
            raise
        try:
            while True:
                item = await self.loop.next_output(queue, STEP_DEADLINE_S)
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.loop.abort(seq)  # no-op once finished

    async def stats(self) -> dict[str, int]:
        return {"num_kv_fetched": self.num_kv_fetched, **self.engine.stats()}

    def check_health(self) -> None:
        if not self.loop.is_alive():
            raise RuntimeError("decode engine thread has stopped")

    def __del__(self):
        if hasattr(self, "loop"):
            self.loop.close()
