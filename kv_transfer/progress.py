"""Layer-wise streaming: KV that is sent while prefill is still computing it.

With ``kv_transfer.layerwise`` the prefill worker leases a prompt's KV as soon as the
prompt is scheduled, not when it is done. Its engine marks each layer as written
(``LayerProgress.mark``, called from the attention layer right after it stores the
layer's keys and values), and the sender streams each (layer, token range) as soon as it
is marked: the chunks of early layers travel while later layers compute. The first token
follows the last chunk (``first_token``), since decode needs it and it only exists once
prefill ends.

Ownership of the blocks moves once. Until prefill ends they belong to the engine, which
may free them (an abort, or a preemption that recomputes the prompt later): ``fail`` is
called first, under the same lock readers hold while they copy, so no reader ever copies
a block that was freed and reused. Once prefill ends, ``StreamedKVSource.own`` hands them
to the lease, as with a finished prefill.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import torch

from kv_transfer.paged import PagedKVSource
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.errors import KVTransferError, PrefillEndedError


class KVNotReadyError(KVTransferError):
    """The streamed KV will not come: prefill failed, was preempted or aborted, or a wait
    ran past its deadline."""


class LayerProgress:
    """How many prompt tokens of each layer are in the blocks, while prefill runs.
    Thread-safe: the engine thread marks, transfer threads wait."""

    def __init__(self, num_layers: int, num_tokens: int, on_start: Callable[[], None] | None = None):
        self.num_tokens = num_tokens
        self.lock = threading.Condition()  # held by readers while they copy (see ``fail``)
        self._written = [0] * num_layers  # tokens of each layer stored so far
        self._first_token: int | None = None
        self._failure: str | None = None
        self._ended = False  # prefill finished the request itself: a failure that is no fault
        self._on_start = on_start  # called once, at the first mark (the prompt was scheduled)

    def mark(self, layer: int, num_tokens: int) -> None:
        """Tokens [0, num_tokens) of ``layer`` are in the blocks (engine thread, per layer)."""
        with self.lock:
            self._written[layer] = num_tokens
            self.lock.notify_all()
        if self._on_start is not None:
            on_start, self._on_start = self._on_start, None
            on_start()

    def finish(self, first_token: int) -> None:
        """Prefill ended: every layer is complete and ``first_token`` was sampled."""
        with self.lock:
            self._written = [self.num_tokens] * len(self._written)
            self._first_token = first_token
            self.lock.notify_all()

    def end(self) -> None:
        """Prefill finished the request at its first token (engine thread, before it frees
        the blocks): readers stop with PrefillEndedError."""
        with self.lock:
            if self._failure is None:
                self._failure, self._ended = "prefill finished the request at its first token", True
            self.lock.notify_all()

    def fail(self, reason: str) -> None:
        """The blocks are about to be freed (or prefill failed): readers stop. Waits for a
        read in progress to end (readers copy under ``lock``)."""
        with self.lock:
            if self._failure is None:
                self._failure = reason
            self.lock.notify_all()
        if self._on_start is not None:  # wake a caller waiting for the start
            on_start, self._on_start = self._on_start, None
            on_start()

    def _wait(self, ready: Callable[[], bool], what: str, deadline: float, alive: Callable[[], bool] | None) -> None:
        """With ``lock`` held: wait until ``ready()``; raises KVNotReadyError on a failure, at
        ``deadline`` (time.monotonic()) or once ``alive()`` is false (checked every 0.1 s)."""
        while self._failure is None and not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVNotReadyError(f"{what} was not ready in time")
            if alive is not None and not alive():
                raise KVNotReadyError(f"the receiver left while waiting for {what}")
            self.lock.wait(min(left, 0.1))
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raises PrefillEndedError or KVNotReadyError once the stream cannot go on."""
        if self._ended:
            raise PrefillEndedError(self._failure)
        if self._failure is not None:
            raise KVNotReadyError(f"streamed KV failed: {self._failure}")

    def wait_layer(self, layer: int, end: int, deadline: float, alive: Callable[[], bool] | None = None) -> None:
        """Block until tokens [0, end) of ``layer`` are written. Raises KVNotReadyError
        (see ``_wait``)."""
        with self.lock:
            self._wait(lambda: self._written[layer] >= end, f"layer {layer} of the streamed KV", deadline, alive)

    def wait_first_token(self, deadline: float, alive: Callable[[], bool] | None = None) -> int:
        """The sampled first token, once prefill ends. Raises KVNotReadyError (see ``_wait``)."""
        with self.lock:
            self._wait(lambda: self._first_token is not None, "the first token", deadline, alive)
            return self._first_token


class StreamedKVSource(PagedKVSource):
    """A prompt's KV as its prefill computes it, in the sequence's own block table (which
    grows chunk by chunk, and is replaced if the sequence is preempted).

    Readers call ``wait_layer`` before each read and read under ``progress.lock``
    (``reading``); the sender's lease covers prefill plus ``kv_lease_s``. ``release`` (the
    lease ended) frees the blocks only if prefill already handed them over (``own``);
    before that the engine owns them and frees them itself when the request is aborted.
    """

    streamed = True

    def __init__(self, kv_cache: PagedKVCache, seq, on_release: Callable[[list[int]], None], progress: LayerProgress):
        self.kv_cache = kv_cache
        self.spec = kv_cache.spec
        self.seq = seq  # pdserve.engine.sequence.Sequence whose prompt this is
        self.num_tokens = seq.num_prompt_tokens
        self.progress = progress
        self._on_release = on_release
        self._owner_lock = threading.Lock()
        self._owns = self._released = False

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table

    def read(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_cache.read(layer, self.kv_cache.slots(self.block_table, start, end))

    def wait_layer(self, layer: int, end: int, deadline: float, alive: Callable[[], bool] | None = None) -> None:
        self.progress.wait_layer(layer, end, deadline, alive)

    @contextlib.contextmanager
    def reading(self):
        """Hold while copying out of the blocks: a preemption or abort waits for the copy,
        then makes later reads fail (``LayerProgress.fail``). Raises KVNotReadyError
        (on enter) if that already happened."""
        with self.progress.lock:
            self.progress.raise_if_failed()
            yield

    def wait_first_token(self, deadline: float, alive: Callable[[], bool] | None = None) -> int:
        return self.progress.wait_first_token(deadline, alive)

    def own(self) -> bool:
        """Prefill ended and handed its blocks to this source. False if the lease had
        already ended: the caller frees them then."""
        with self._owner_lock:
            if self._released:
                return False
            self._owns = True
            return True

    def release(self) -> None:
        with self._owner_lock:
            self._released, owns = True, self._owns
        if owns:
            self._on_release(self.block_table)
        else:  # still the engine's: only stop the readers
            self.progress.fail("the KV lease ended before prefill finished")

