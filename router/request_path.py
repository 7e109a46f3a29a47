"""One request's path through the pools: prefill -> KV hand-off -> streamed decode, and
what happens when a replica dies on the way. (A short prompt, or one that would wait too
long for the prefill pool, is prefilled by the decode replica itself: router/placement.py.)

A request that ends before decode has acknowledged its KV (a client that left, a stop
string, a failed decode) has prefill's lease released at once, over the KV channel at the
replica that holds it; a lease nobody releases expires after ``prefill.kv_lease_s``.

- A prefill replica dies (its call fails with a Ray actor error) or hangs (its engine
  step outlasts ``max_step_s``: WorkerStalledError): the prefill is sent again, to another
  replica.
- A decode replica dies or hangs mid-stream: the request migrates. Another decode replica
  gets the prompt plus every token already streamed, recomputes their KV (as a prefill)
  and goes on from the next token, so the client's stream has no gap and no repeat.

How many times and how far apart: router/retries.py (``max_retries`` per stage for dead
replicas; for a hung one, until Ray Serve's health checks have taken it out of routing).

With ``kv_transfer.layerwise`` the decode call starts as soon as prefill has scheduled
the prompt (``PrefillStarted``), so decode fetches each layer's KV while later layers
compute; the path is otherwise the same. A layer-wise stream that breaks before prefill's
first token reached decode is resent to decode with the token (``FirstTokenMissingError``),
which recomputes the prompt there, as a migration does.

Every stage has a deadline in the worker that runs it: prefill ``PREFILL_DEADLINE_S``,
the KV fetch ``kv_transfer.timeout_s``, each decode token ``max_step_s + STEP_DEADLINE_S``;
and a worker whose engine step outlasts its pool's ``max_step_s`` fails its requests
with WorkerStalledError at once (retried or migrated as above).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from typing import Any, AsyncIterator

from ray.exceptions import RayActorError

from kv_transfer.base import KVHandle, KVReceiver
from pdserve.callers import Caller
from pdserve.errors import FirstTokenMissingError, KVTransferError, WorkerStalledError
from pdserve.messages import (ALL_CHOICES, ChoiceState, DecodeRequest, FreshRequest, LayerwiseKV, Migrated, PrefillRequest, PrefillResult,
                              PrefillStarted, TokenChunk, WithKV)
from pdserve.sampling import SamplingParams
from router.placement import PrefillPlacement
from router.retries import Attempts, RetryPolicy

log = logging.getLogger(__name__)

# the replica's actor died or cannot be reached (ActorDiedError, ActorUnavailableError),
# or its engine is stuck in a step (it fails its health check and is being replaced)
REPLICA_GONE = (RayActorError, WorkerStalledError)
RELEASE_TIMEOUT_S = 5.0  # a lease release over the KV channel


class RequestPath:
    """``prefill``/``decode``: Ray Serve deployment handles (``prefill`` None in colocated
    mode); ``prefill_retries``/``decode_retries``: when each stage is sent again (router/retries.py);
    ``caller``: this router replica (None outside Ray)."""

    def __init__(self, prefill, decode, prefill_retries: RetryPolicy, decode_retries: RetryPolicy, layerwise: bool = False,
                 kv_releaser: KVReceiver | None = None, placement: PrefillPlacement | None = None, caller: Caller | None = None):
        self.prefill, self.decode = prefill, decode
        self.caller = caller  # this router replica, named in every call: the pools stop its requests if it dies (pdserve/callers.py)
        self.placement = placement or PrefillPlacement()  # which pool prefills (router/placement.py); none given: always prefill's
        self.kv_releaser = kv_releaser  # releases a lease at the replica that holds it, over the KV channel
        self.prefill_retries, self.decode_retries = prefill_retries, decode_retries
        self.layerwise = layerwise
        self.num_prefill_retries = 0
        self.num_migrations = 0
        self.num_resent = 0  # layer-wise requests resent to decode with their first token
        self._background: set[asyncio.Future] = set()  # clean-up tasks, held until done (the loop keeps weak refs)

    async def stream(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        """The request's tokens as the pools produce them. Close it early (a stop string, a
        client that left) and both pools free what they hold at once."""
        local = self.prefill is None or self.placement.choose_local(len(prompt_ids))
        if local:  # colocated, or prefilled by the decode replica itself (router/placement.py); with n > 1, forked there
            streamed = {i: [] for i in range(params.n)} if params.n > 1 else []
            items = self._decode(FreshRequest(request_id, prompt_ids, params, caller=self.caller), streamed)
            prefilling = self.prefill is not None
            if prefilling:
                self.placement.started(True, len(prompt_ids))
            try:
                async for item in items:
                    if prefilling:  # the first token came: the local prefill is done
                        prefilling = False
                        self.placement.finished(True, len(prompt_ids))
                    yield item
            finally:
                if prefilling:
                    self.placement.finished(True, len(prompt_ids))
                await items.aclose()  # at once, not at garbage collection: the pool frees the request now
            return
        if params.n > 1:
            items = self._stream_choices(request_id, prompt_ids, params)
            try:
                async for item in items:
                    yield item
            finally:
                await items.aclose()
            return
        early_decode = None  # layer-wise: the decode call, started while prefill runs
        ahead, start, took = self.placement.started(False, len(prompt_ids)), time.perf_counter(), None
        try:
            if self.layerwise and params.max_tokens > 1:
                first, early_decode = await self._prefill_layerwise(PrefillRequest(request_id, prompt_ids, params, self.caller))
            else:
                first = await self._prefill(PrefillRequest(request_id, prompt_ids, params, self.caller))
            took = time.perf_counter() - start
        finally:
            self.placement.finished(False, len(prompt_ids), took, ahead)
        first_logprobs = [first.first_logprob] if first.first_logprob else None
        if first.finish_reason is not None:  # done after one token: decode never runs
            if early_decode is not None:
                early_decode.cancel()
            stopped = first.finish_reason == "stop"  # the stop token is not returned
            yield TokenChunk([] if stopped else [first.first_token], first.finish_reason, None if stopped else first_logprobs)
            return
        finished, items = False, None
        try:
            yield TokenChunk([first.first_token], None, first_logprobs)
            items = self._decode(WithKV(request_id, prompt_ids, params, first.first_token, first.kv, caller=self.caller), [first.first_token], early_decode)
            async for item in items:
                finished = item.finish_reason is not None
                yield item
        finally:
            if items is not None:
                await items.aclose()
            if items is None and early_decode is not None:  # left before decode was read: stop it
                early_decode.cancel()
                self._abort_decode(request_id)
            if not finished:  # cancelled, failed or stopped by a stop string: prefill frees its copy now
                self._release(first.kv)

    async def _stream_choices(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        """An n > 1 request prefilled by the prefill pool, once: it draws each choice's first
        token, and decode forks the prompt's KV into the choices. Chunks carry their choice's
        index; the stream ends when every choice has. Never layer-wise: the first tokens come
        with the PrefillResult."""
        ahead, start, took = self.placement.started(False, len(prompt_ids)), time.perf_counter(), None
        try:
            first = await self._prefill(PrefillRequest(request_id, prompt_ids, params, self.caller))
            took = time.perf_counter() - start
        finally:
            self.placement.finished(False, len(prompt_ids), took, ahead)
        going = [ChoiceState(c.index, (c.token_id,)) for c in first.choices if c.finish_reason is None]
        finished, items = not going, None  # with none going on, prefill holds no KV
        try:
            for c in first.choices:
                stopped = c.finish_reason == "stop"
                yield TokenChunk([] if stopped else [c.token_id], c.finish_reason, None if c.logprob is None else ([] if stopped else [c.logprob]), c.index)
            if not going:
                return
            request = WithKV(request_id, prompt_ids, params, going[0].streamed[0], first.kv, caller=self.caller, choices=tuple(going))
            items = self._decode(request, {c.index: list(c.streamed) for c in going})
            async for item in items:
                yield item
            finished = True
        finally:
            if items is not None:
                await items.aclose()
            if not finished:
                self._release(first.kv)

    async def _decode(self, request: DecodeRequest, streamed: list[int] | dict[int, list[int]], call=None) -> AsyncIterator[TokenChunk]:
        """Stream ``request`` from the decode pool; if the replica dies, migrate (see above).
        ``streamed``: the tokens the client already has (the first one, in disaggregated mode);
        with n > 1, of each choice still open, by index. ``call``: the decode call already
        started for it (layer-wise), if any."""
        many = request.params.n > 1
        streamed = {k: list(v) for k, v in streamed.items()} if many else {0: list(streamed)}  # the open choices' tokens
        attempts = Attempts(self.decode_retries)
        while True:
            stream, call, finished, retry = call or self.decode.options(stream=True).generate.remote(request), None, False, False
            try:
                async for item in stream:
                    index = item.index if many else 0
                    if index in streamed:
                        streamed[index].extend(item.token_ids)
                    if item.finish_reason is not None:
                        streamed.pop(index, None)
                        finished = not streamed or item.index == ALL_CHOICES or not many
                    yield item
                    if finished:
                        return
                return
            except (*REPLICA_GONE, FirstTokenMissingError) as e:
                resend, num_streamed = isinstance(e, FirstTokenMissingError), sum(map(len, streamed.values()))
                if resend and not num_streamed:
                    raise
                if isinstance(request, (WithKV, LayerwiseKV)):  # it may have died before fetching: free prefill's copy now
                    self._release(request.kv)
                await attempts.before_retry(e, wait=not resend)  # re-raises when out of attempts
                if resend:
                    self.num_resent += 1
                    log.warning("layer-wise KV for %s broke before its first token (%s); resending it with the token", request.request_id, e)
                else:
                    self.num_migrations += 1
                    log.warning("decode replica lost for %s after %d tokens (%s); migrating", request.request_id, num_streamed, type(e).__name__)
                if many and num_streamed:  # each open choice goes on after what the client has of it
                    choices = tuple(ChoiceState(i, tuple(tokens)) for i, tokens in sorted(streamed.items()))
                    request = Migrated(request.request_id, request.prompt_ids, request.params, (), caller=self.caller, choices=choices)
                elif not many and streamed[0]:  # go on after what the client has; with nothing yet (colocated), send it again as it was
                    request = Migrated(request.request_id, request.prompt_ids, request.params, tuple(streamed[0]), caller=self.caller)
                retry = True
            finally:
                if not finished:
                    stream.cancel()
                    if not retry:  # given up (client gone, stop string, error): stop it by id too
                        self._abort_decode(request.request_id)

    async def _prefill(self, request: PrefillRequest) -> PrefillResult:
        """The prefill call, retried on another replica if its replica dies.

        Each call is a child of this request, so Ray Serve cancels it when the request is
        cancelled. If the request is cancelled while the reply is on its way (prefill done,
        KV leased), the lease is released when the reply lands instead of left to expire."""
        attempts = Attempts(self.prefill_retries)
        while True:
            call = asyncio.ensure_future(self.prefill.prefill.remote(request))
            try:
                return await asyncio.shield(call)
            except asyncio.CancelledError:
                self._background.add(call)
                call.add_done_callback(functools.partial(self._release_orphan, request.request_id))
                raise
            except REPLICA_GONE as e:
                await self._before_prefill_retry(request, e, attempts)

    async def _before_prefill_retry(self, request: PrefillRequest, error: BaseException, attempts: Attempts) -> None:
        """A prefill replica died or stalled: re-raise ``error`` if ``attempts`` are used up,
        else back off and count the retry."""
        await attempts.before_retry(error)
        self.num_prefill_retries += 1
        log.warning("prefill replica lost for %s (%s); retrying on another", request.request_id, type(error).__name__)

    async def _prefill_layerwise(self, request: PrefillRequest) -> tuple[PrefillResult, Any]:
        """Prefill with the decode call started as soon as prefill has scheduled the prompt
        (``PrefillStarted``). Returns (PrefillResult, the decode call or None). A prefill
        replica that dies is retried as in ``_prefill``, after its decode call is stopped."""
        attempts = Attempts(self.prefill_retries)
        while True:
            calls, decode, handle = self.prefill.options(stream=True).prefill_layerwise.remote(request), None, None
            try:
                item = await calls.__anext__()
                if isinstance(item, PrefillStarted):
                    handle = item.kv
                    decode = self.decode.options(stream=True).generate.remote(
                        LayerwiseKV(request.request_id, request.prompt_ids, request.params, handle, caller=self.caller))
                    item = await calls.__anext__()
                return item, decode
            except BaseException as e:
                calls.cancel()
                if decode is not None:
                    decode.cancel()
                if handle is not None:
                    self._release(handle)
                if not isinstance(e, REPLICA_GONE):
                    raise
                await self._before_prefill_retry(request, e, attempts)

    def _release_orphan(self, request_id: str, call: asyncio.Future) -> None:
        """The prefill call of a request cancelled meanwhile has ended: free its lease. If Ray
        Serve cancelled the call too, its reply (and handle) may be lost after the replica
        leased the KV: release by the request id, the id prefill leases under (a release
        that comes first is remembered: kv_transfer/lease.py)."""
        self._background.discard(call)
        if call.cancelled() or call.exception() is not None:
            self._release(request_id)
        elif call.result().kv is not None:
            self._release(call.result().kv)

    def _release(self, kv: KVHandle | str) -> None:
        """Ask prefill to free a lease now; fire and forget (an unanswered lease expires).

        With the handle, over the KV channel to the replica that holds the lease (a Ray Serve
        call would go to any replica of the pool); with the id alone (the reply, and with it
        the handle, was lost), or where there is no KV channel (loopback), through Ray Serve
        to the replica the prefill call was routed to (router/holder_routing.py), outside
        this request's context: when a request is cancelled, Ray Serve cancels its
        child calls not yet assigned to a replica, and this one must run."""
        if isinstance(kv, KVHandle) and self.kv_releaser is not None and kv.backend != "loopback":
            done = asyncio.get_running_loop().run_in_executor(None, self._release_at_holder, kv)
            self._background.add(done)
            done.add_done_callback(self._background.discard)
            return
        contextvars.Context().run(self.prefill.release.remote, kv if isinstance(kv, str) else kv.transfer_id)

    def _abort_decode(self, request_id: str) -> None:
        """Tell the decode pool to stop a request, beside cancelling its call: Ray Serve loses
        that cancel now and then under load (a fresh-clone trial on 2026-12-01: 3 of ~18 runs of
        16 streams whose clients left, 1-5 requests each, decoded on to max_tokens, their
        decode call never cancelled). Fire and forget, outside this request's context (see
        _release). It goes to the decode replica the request was routed to
        (router/holder_routing.py); an abort that finds nothing there is remembered a while
        (decode_worker/server.py)."""
        contextvars.Context().run(self.decode.abort.remote, request_id)

    def _release_at_holder(self, handle: KVHandle) -> None:
        try:
            self.kv_releaser.release(handle, RELEASE_TIMEOUT_S)
        except KVTransferError as e:
            log.warning("releasing KV %s failed (%s); its lease will expire", handle.transfer_id, e)
