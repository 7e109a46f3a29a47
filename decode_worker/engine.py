"""DecodeEngine: the decode worker's step loop, on its own thread.

Iteration-level scheduling: requests join and leave between steps; each step
advances every running request by one token. Outputs go to each request's
asyncio queue on the replica's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from pdserve.messages import TokenChunk
from pdserve.runner import ModelRunner
from pdserve.sampling import SamplingParams, finish_reason, sample

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    request_id: str
    params: SamplingParams
    last_token: int  # the newest token, not yet in the cache
    num_generated: int  # tokens generated so far, first token included
    kv: torch.Tensor | None  # prompt KV until admitted: [num_layers, 2, kv_heads, tokens, head_dim]
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    cache: DynamicCache | None = None
    aborted: bool = field(default=False)

    def emit(self, item: TokenChunk | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class DecodeEngine:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._inbox: queue.Queue[Sequence] = queue.Queue()
        self._seqs: dict[str, Sequence] = {}  # every live request, waiting or running
        self._running: dict[str, Sequence] = {}  # admitted: has a cache (engine thread only)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.num_steps = 0  # decode forwards run
        self.num_finished = 0
        self.num_aborted = 0
        self._thread = threading.Thread(target=self._loop, daemon=True, name="decode-engine")
        self._thread.start()

    def add(self, request_id: str, params: SamplingParams, first_token: int, kv: torch.Tensor) -> asyncio.Queue:
        """Queue a request whose first token is already generated; returns its output queue.

        Must be called from the event loop that will read the queue.
        """
        seq = Sequence(request_id, params, first_token, 1, kv, asyncio.Queue(), asyncio.get_running_loop())
        self._seqs[request_id] = seq
        self._inbox.put(seq)
        self._wake.set()
        return seq.out

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its KV is dropped before the next step."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            seq.aborted = True
            self._wake.set()

    def stats(self) -> dict[str, int]:
        return {
            "num_running": len(self._running),
            "num_waiting": len(self._seqs) - len(self._running),
            "num_steps": self.num_steps,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
        }

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    def _admit(self) -> None:
        while True:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._running[seq.request_id] = seq
            seq.cache = self.runner.cache_from_kv(seq.kv)
            seq.kv = None

    def _step(self, seq: Sequence) -> None:
        logits = self.runner.decode(seq.cache, seq.last_token)
        self.num_steps += 1
        position = seq.cache.get_seq_length()
        token = sample(logits, seq.params, position=position)
        seq.num_generated += 1
        reason = finish_reason(token, seq.num_generated, seq.params, self.runner.eos_token_ids)
        seq.last_token = token
        seq.emit(TokenChunk([] if reason == "stop" else [token], reason))
        if reason is not None:
            self._finish(seq)
            self.num_finished += 1

    def _finish(self, seq: Sequence) -> None:
        self._running.pop(seq.request_id, None)
        self._seqs.pop(seq.request_id, None)
        seq.cache = None
        seq.kv = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._admit()
            if not self._running:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            for seq in list(self._running.values()):
                if seq.aborted:
                    self._finish(seq)
                    self.num_aborted += 1
                    continue
                try:
                    self._step(seq)
                except Exception as e:  # a failed forward fails its request, not the worker
                    log.exception("decode step failed for %s", seq.request_id)
                    seq.emit(e)
                    self._finish(seq)
