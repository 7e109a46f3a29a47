"""EngineLoop: runs ``Engine.step()`` on its own thread and streams results to asyncio.

Requests are submitted from the replica's event loop; each gets an asyncio.Queue
of TokenChunk (or an exception). New requests and aborts are queued and applied
between steps, so the event loop never waits for a forward (an engine add takes the
engine's lock: done on the event loop, it held the replica up for a whole step, and a
prefill replica given several long prompts answered cancels and releases only after
all of them had been prefilled).

A step that runs longer than ``max_step_s`` (a hung forward) fails the replica's Ray
Serve health check, and every request waiting on this loop, and every new one, gets
``WorkerStalledError`` at once: the router sends them to another replica while Ray Serve
replaces this one.

Fault injection for tests: with ``PDSERVE_FAULT_HANG_FILE`` set in a replica's
environment, the first loop to find that file there takes it (renames it, so one replica
of the pool does) and hangs in its next step until closed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from pdserve.engine.engine import Engine
from pdserve.engine.sequence import Sequence, SeqStatus
from pdserve.errors import WorkerStalledError
from pdserve.messages import ALL_CHOICES, TokenChunk

log = logging.getLogger(__name__)


HANG_FILE_ENV = "PDSERVE_FAULT_HANG_FILE"
STALL_POLL_S = 1.0  # a waiting request checks this often whether the loop is stuck


class EngineLoop:
    """``max_step_s``: seconds one step may run before the loop counts as stalled; ``nice``:
    the engine thread's niceness (Linux), inherited by the kernel threads it starts;
    ``gate``: its ``before_step()`` and ``after_step()`` run around every step, on the step's
    thread (pdserve/core_share.py: a prefill engine marks its steps, a decode engine waits
    for them); closed with the loop."""

    def __init__(self, engine: Engine, max_step_s: float = 120.0, nice: int = 0, gate=None):
        self.engine = engine
        self.max_step_s = max_step_s
        self.nice = nice
        self.gate = gate
        self._hang_file = os.environ.get(HANG_FILE_ENV)
        # request id -> (its queue, the queue's event loop, ids of its sequences not yet finished):
        # only those sequences' chunks reach the queue (a request id can be submitted again, as
        # an n > 1 request is after decode prefills it: the earlier sequence's late chunk is not)
        self._outputs: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop, set[int]]] = {}
        self._adds: list[Sequence] = []
        self._aborts: list[Sequence] = []
        self._lock = threading.Lock()  # guards _adds and _aborts
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._step_started: float | None = None  # monotonic time the running step began; None while idle
        self._thread = threading.Thread(target=self._run, daemon=True, name="engine-loop")
        self._thread.start()

    def submit(self, seq: Sequence) -> asyncio.Queue:
        """Queue ``seq``; call from the event loop that reads the returned queue.

        Raises InvalidRequestError if the sequence could never fit in the KV pool or its
        structured output cannot be served (its grammar is built here, not on the step
        thread: Engine.prepare), WorkerStalledError if a step is stuck.
        """
        return self.submit_group([seq])

    def submit_group(self, seqs: list[Sequence]) -> asyncio.Queue:
        """Queue the choices of one request (an n > 1 request's forks: one request id, each
        its ``index``) with one queue for all; their chunks carry the index, and the stream
        closes when each has finished. Raises as ``submit``, before any is queued."""
        self.raise_if_stalled()
        for seq in seqs:
            self.engine.check_fits(seq)
            self.engine.prepare(seq)
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._outputs[seqs[0].request_id] = (queue, asyncio.get_running_loop(), {id(seq) for seq in seqs})
            self._adds.extend(seqs)  # the engine thread adds them before its next step
        self._wake.set()
        return queue

    def end_stream(self, request_id: str) -> bool:
        """End a submitted request's stream now: its queue gets ``TokenChunk([], "abort")``, and
        its reader (who must then call ``abort``) stops. Call from the event loop. Returns
        False if no stream of that id is open here."""
        target = self._outputs.get(request_id)
        if target is None:
            return False
        queue, loop, _ = target
        loop.call_soon_threadsafe(queue.put_nowait, TokenChunk([], "abort", index=ALL_CHOICES))
        return True

    def abort(self, seq: Sequence) -> None:
        """Drop a request (client gone); its blocks are freed before the next step.

        Also frees the blocks a finished prefill sequence kept for hand-off, so call
        it only while nobody else (a KV lease) owns them.
        """
        with self._lock:
            target = self._outputs.get(seq.request_id)
            if target is not None and id(seq) in target[2]:
                del self._outputs[seq.request_id]
            self._aborts.append(seq)
        self._wake.set()

    async def next_output(self, queue: asyncio.Queue, timeout_s: float, deadline_name: str = "output deadline") -> TokenChunk:
        """The next chunk from a ``submit`` queue; re-raises a failed step's exception.

        Raises TimeoutError after ``timeout_s`` seconds, naming ``deadline_name``, its value
        and the engine's load; WorkerStalledError once a step has been stuck for
        ``max_step_s`` (checked every STALL_POLL_S of waiting).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                item = await asyncio.wait_for(queue.get(), timeout=max(0.0, min(left, STALL_POLL_S)))
                break
            except TimeoutError:
                self.raise_if_stalled()
                if left <= STALL_POLL_S:
                    stats = self.engine.stats()
                    raise TimeoutError(f"{deadline_name} of {timeout_s:g} s passed with nothing from the engine "
                                       f"({stats.get('num_running', 0)} requests running, {stats.get('num_waiting', 0)} waiting)") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stalled_s(self) -> float:
        """Seconds the current step has run; 0 while the loop is idle (an idle loop is never stalled)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def check_health(self) -> None:
        """For Ray Serve's health check: raises RuntimeError if the loop thread died, or
        WorkerStalledError (a RuntimeError) if one step has run longer than ``max_step_s``
        seconds (a hung forward), or where a tensor-parallel rank died. Ray Serve then replaces this replica alone; its peers see
        failed calls, which they retry, migrate or recompute."""
        if not self.is_alive():
            raise RuntimeError("engine thread has stopped")
        self.raise_if_stalled()

    def raise_if_stalled(self) -> None:
        """Raises WorkerStalledError if the current step has run over ``max_step_s``, or the
        engine cannot step again (a tensor-parallel rank died): the router sends the requests
        elsewhere at once."""
        broken = self._broken()
        if broken is not None:
            raise WorkerStalledError(f"this replica cannot step: {broken}")
        stalled_s = self.stalled_s()
        if stalled_s > self.max_step_s:
            raise WorkerStalledError(f"engine step stuck for {stalled_s:.0f} s (over max_step_s {self.max_step_s:g} s)")

    def _broken(self) -> str | None:
        """Why the engine can never step again (Engine.check_health), or None."""
        try:
            self.engine.check_health()
        except RuntimeError as e:
            return str(e)
        return None

    def _take_hang_file(self) -> bool:
        try:
            os.rename(self._hang_file, f"{self._hang_file}.taken-by-{os.getpid()}")
        except OSError:  # not there, or another replica took it
            return False
        return True

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the loop after its current step; wait up to ``wait_s`` for its thread, which
        closes the engine as it ends (tensor-parallel ranks, a shared pool)."""
        self._stop.set()
        self._wake.set()
        if wait_s > 0 and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(wait_s)

    def _emit(self, seq: Sequence, item: TokenChunk | BaseException) -> None:
        with self._lock:
            target = self._outputs.get(seq.request_id)
        if target is not None and id(seq) in target[2]:
            queue, loop, _ = target
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # its event loop has closed: nobody will read this request's queue
                self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        """No more chunks for ``seq``'s request."""
        with self._lock:
            target = self._outputs.get(seq.request_id)
            if target is not None and id(seq) in target[2]:
                del self._outputs[seq.request_id]

    def _finished(self, seq: Sequence) -> None:
        """``seq`` has finished: its request's stream closes once each of its sequences has."""
        with self._lock:
            target = self._outputs.get(seq.request_id)
            if target is not None and id(seq) in target[2]:
                target[2].discard(id(seq))
                if not target[2]:
                    del self._outputs[seq.request_id]

    def _gate(self, call: str) -> None:
        """The gate's ``before_step`` or ``after_step``; a gate that raises is logged, closed and
        dropped (the engine steps on without taking turns) rather than failing the step."""
        if self.gate is None:
            return
        try:
            getattr(self.gate, call)()
        except Exception:  # noqa: BLE001 - taking turns is an optimisation, never a reason to fail requests
            log.exception("engine gate %s failed; stepping without it from now on", call)
            self._drop_gate()

    def _drop_gate(self) -> None:
        gate, self.gate = self.gate, None
        if gate is not None:
            try:
                gate.close()
            except Exception:  # noqa: BLE001
                log.exception("engine gate close failed")

    def _set_nice(self) -> None:
        """Give this (the engine) thread its niceness; on Linux setpriority with a thread id
        sets that thread alone. A lower value than the process's needs CAP_SYS_NICE: without
        it the thread keeps the process's and a warning says so."""
        if not self.nice or not hasattr(os, "setpriority"):
            return
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        except OSError as e:
            log.warning("engine thread niceness %d not set (%s); it runs at the process's", self.nice, e)

    def _run(self) -> None:
        self._set_nice()
        try:
            self._steps()
        finally:  # the engine's tensor-parallel ranks and shared pool go with its thread
            try:
                self.engine.close()
            finally:
                self._drop_gate()

    def _steps(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            for seq in adds:  # before the aborts: one may be for a request added in the same round
                try:
                    self.engine.add(seq)
                except Exception as e:  # checked at submit; anything else fails this request alone
                    self._emit(seq, e)
                    self._drop(seq)
            for seq in aborts:
                if seq.status is not SeqStatus.FINISHED:
                    self.engine.abort(seq)
                elif seq.block_table:  # kept for a hand-off that will not happen
                    self.engine.free_blocks(seq.block_table)
                    seq.block_table = []
            if not self.engine.scheduler.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            steps_before = self.engine.num_steps
            self._step_started = time.monotonic()
            if self._hang_file and self._take_hang_file():
                log.error("fault injection (%s): this engine step hangs", HANG_FILE_ENV)
                self._stop.wait()
                return
            self._gate("before_step")
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed forward fails the requests in it, not the worker
                self._gate("after_step")
                self._step_started = None
                log.exception("engine step failed")
                broken = self._broken()
                if broken is not None:  # for good: its requests go to another replica (router/retries.py)
                    e = WorkerStalledError(f"this replica cannot step: {broken}")
                for seq in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
                    self.engine.abort(seq)
                    self._emit(seq, e)
                    self._drop(seq)
                continue
            self._gate("after_step")
            self._step_started = None
            for seq in outputs:
                reason = seq.finish_reason
                stopped = reason == "stop"  # the stop token itself is not returned
                logprobs = None if seq.params.logprobs is None else ([] if stopped else seq.logprobs[-1:])
                self._emit(seq, TokenChunk([] if stopped else [seq.token_ids[-1]], reason, logprobs, seq.index))
                if seq.status is SeqStatus.FINISHED:
                    self._finished(seq)
            if self.engine.num_steps == steps_before:  # work is waiting for blocks: don't spin
                self._wake.wait(timeout=0.005)
                self._wake.clear()
