"""Prefill and decode replicas of one small node taking turns on its cores instead of contending for them.

On a small node (2 cores: one prefill and one decode replica), an engine given more threads
than CPUs (``num_threads: 2`` with ``num_cpus: 1``) runs its kernels on the other replica's
core too. When both step at once they share that core, and each parallel kernel waits on its
slower thread: a 256-token prefill on 2 threads took longer beside a decode loop than on 1
thread. With ``decode.yield_to_prefill_s`` > 0 the two take turns:

- a decode engine waits before each step while a prefill step on its node runs, at most
  ``yield_to_prefill_s`` seconds (its streams' TPOT bound), and then steps anyway;
- a prefill engine marks its step first, then waits for a decode step already running to
  end, at most ``PREFILL_WAIT_S``.

Each engine publishes one 8-byte word in shared memory (``/dev/shm``, named by its role, the
node and the process): the monotonic clock (CLOCK_MONOTONIC, one clock for every process of
the host) when its running step began, 0 between steps. Prefill sets its word, then looks at
decode's; decode looks at prefill's, sets its own and looks again (and clears it and waits
while a prefill step has begun meanwhile), so that at most one step of each overlaps when
both start at once (the words carry no lock: an overlap costs time, never a result). A word
busy for longer than ``STALE_S`` (a hung step) is not waited for, and a dead process's word
is removed at the next look for new engines (``RESCAN_S``). EngineLoop fails open: a gate
that raises is logged and dropped, and the engine steps on alone.

Measured on an Intel Xeon (AMX, 2 cores, bf16), 2026-12-07: a 256-token prefill on 2 threads
beside a batch-8 decode loop in another process took a median 112 ms (p90 131) with decode
stepping throughout, 77 ms (p90 105) with decode's engine thread at nice 10, and 66 ms (p90
71) with decode waiting for it; 70 ms with no decode running.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import struct
import tempfile
import time
from pathlib import Path

PREFIX = "pdserve-busy-"  # then the role, the node, the process and a counter
STALE_S = 2.0  # a step busy this long is hung (or a torn word): no longer waited for (config.py caps yield_to_prefill_s at it)
PREFILL_WAIT_S = 0.1  # the longest a prefill step waits for a running decode step (one step at batch 64, 2 threads, is ~40 ms)
POLL_S = 0.0005  # how often a waiting engine looks at the words
RESCAN_S = 1.0  # how often it looks for new engines of the other role on its node
ROLES = ("prefill", "decode")
_ids = itertools.count()


def signal_dir() -> Path:
    """Where the words live: /dev/shm, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _scope(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "", node)[:32] or "node"


def gate_for(yield_to_prefill_s: float, pool: str, node: str) -> "CoreShare | None":
    """The gate of a ``pool`` engine on ``node`` (EngineLoop's ``gate``): with
    ``decode.yield_to_prefill_s`` > 0, prefill's (waits PREFILL_WAIT_S at most) or decode's
    (waits that long at most); None for colocated or when the engines do not take turns."""
    if not yield_to_prefill_s > 0 or pool not in ROLES:
        return None
    return CoreShare(node, pool, PREFILL_WAIT_S if pool == "prefill" else yield_to_prefill_s)


class CoreShare:
    """An engine's gate (EngineLoop's ``gate``): ``role`` "prefill" or "decode", ``node`` its
    node's id (kv_transfer.factory.node_id), ``max_wait_s`` the longest ``before_step`` waits
    for the other role's steps. ``num_waits`` counts the steps that waited and ``wait_s`` the
    seconds they waited. Raises ValueError for an unknown role or a wait that is not > 0."""

    def __init__(self, node: str, role: str, max_wait_s: float, directory: Path | None = None):
        if role not in ROLES or not max_wait_s > 0:
            raise ValueError(f"role must be one of {ROLES} and max_wait_s > 0, not {role!r} and {max_wait_s!r}")
        self.role, self.max_wait_s, self.dir = role, max_wait_s, directory or signal_dir()
        other = ROLES[1 - ROLES.index(role)]
        self.prefix = f"{PREFIX}{other}-{_scope(node)}-"  # the other role's words on this node
        self.path = self.dir / f"{PREFIX}{role}-{_scope(node)}-{os.getpid()}-{next(_ids)}"
        with open(self.path, "wb") as f:
            f.write(b"\0" * 8)
        with open(self.path, "r+b") as f:
            self._word = mmap.mmap(f.fileno(), 8)
        self._others: dict[str, mmap.mmap] = {}
        self._scanned = float("-inf")
        self.num_waits, self.wait_s = 0, 0.0

    def _rescan(self) -> None:
        names = set()
        for path in self.dir.glob(self.prefix + "*"):
            try:
                pid = int(path.name[len(self.prefix):].split("-")[0])
                if pid != os.getpid() and not _alive(pid):
                    path.unlink(missing_ok=True)  # its process died, mid-step or not
                    continue
                if path.name not in self._others:
                    with open(path, "r+b") as f:
                        self._others[path.name] = mmap.mmap(f.fileno(), 8)
                names.add(path.name)
            except (OSError, ValueError):  # not a word of ours, gone, not yet written, or another user's
                continue
        for name in set(self._others) - names:
            self._others.pop(name).close()

    def busy(self) -> bool:
        """Whether a step of the other role on this node began less than STALE_S ago and has not ended."""
        now = time.monotonic_ns()
        return any(0 < (since := struct.unpack_from("q", word, 0)[0]) <= now and now - since < STALE_S * 1e9
                   for word in self._others.values())

    def _wait(self, start: float) -> None:
        while self.busy() and time.monotonic() - start < self.max_wait_s:
            time.sleep(POLL_S)

    def before_step(self) -> None:
        start = time.monotonic()
        if start - self._scanned >= RESCAN_S:
            self._rescan()
            self._scanned = start
        mark = lambda: struct.pack_into("q", self._word, 0, time.monotonic_ns())  # noqa: E731
        if self.role == "prefill" or not self._others:
            mark()
            if not self._others or not self.busy():
                return
            self._wait(start)  # a decode step already running: let it end
        else:
            if not self.busy():
                mark()
                if not self.busy():
                    return
                self.after_step()  # a prefill marked its step meanwhile: it goes first
            while True:
                self._wait(start)
                mark()
                if not self.busy() or time.monotonic() - start >= self.max_wait_s:
                    break
                self.after_step()
        self.num_waits += 1
        self.wait_s += time.monotonic() - start

    def after_step(self) -> None:
        struct.pack_into("q", self._word, 0, 0)

    def stats(self) -> dict[str, float]:
        """decode: ``num_prefill_yields`` and ``prefill_yield_s``; prefill: ``num_decode_waits`` and ``decode_wait_s``."""
        return ({"num_prefill_yields": self.num_waits, "prefill_yield_s": self.wait_s} if self.role == "decode"
                else {"num_decode_waits": self.num_waits, "decode_wait_s": self.wait_s})

    def close(self) -> None:
        for word in self._others.values():
            word.close()
        self._others.clear()
        try:
            self.after_step()
            self._word.close()
        except (ValueError, BufferError):
            pass
        self.path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True
