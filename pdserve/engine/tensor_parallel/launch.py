"""How a replica starts its tensor-parallel ranks 1 .. n-1, and how it sees one die.

- **Ray actors** when rank 0 runs in a Ray placement group of at least n bundles (a Serve
  replica of a pool with ``tensor_parallel_size: n``, deploy.py): rank r is a ``TPRankActor``
  in bundle r, holding that bundle's resources. STRICT_PACK puts every bundle on rank 0's
  node, so the ranks meet over a Unix socket in the abstract namespace and share memory.
  Ray fate-shares the actors with rank 0, their owner.
- **Child processes** otherwise (an engine outside Ray: benchmarks, tests, ``pdserve``'s
  local tools): forked over a socket pair by the process's forkserver (forkserver.py), which
  has imported torch and the engine once.

Either way a rank is a connection (multiprocessing.connection.Connection) and a handle
(``pid``, ``exited()``, ``wait()``, ``stop()``), and runs group.worker_main.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import select
import signal
import socket
import sys
import threading
import time
import uuid
from multiprocessing.connection import Connection

from pdserve.engine.tensor_parallel import forkserver

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a waiting rank 0 looks at its actors while they start
HELLO_BYTES = 34  # an actor's first bytes: rank 0's token (32) and its rank (2)
HELLO_TIMEOUT_S = 10.0  # longest a connection may take to send them


def _recv_exact(sock: socket.socket, n: int, timeout_s: float) -> bytes:
    """Up to ``n`` bytes within ``timeout_s`` (fewer where the peer stops or is too slow)."""
    sock.settimeout(timeout_s)
    data, end = b"", time.monotonic() + timeout_s
    try:
        while len(data) < n and (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(n - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data


class ChildRank:
    """Rank ``rank`` as a child process, forked by this process's forkserver (forkserver.py),
    which has the rank's imports done. ``exited``, ``wait`` and ``stop`` read the exit code
    the forkserver reports on a pipe (-1 where the forkserver died before the rank)."""

    def __init__(self, rank: int):
        ours, theirs = socket.socketpair()
        status_r, status_w = os.pipe()
        try:
            self.pid = forkserver.get().start(theirs.fileno(), status_w, rank)
        except BaseException:
            ours.close()
            os.close(status_r)
            raise
        finally:
            theirs.close()
            os.close(status_w)
        self.conn = Connection(ours.detach())
        self._status = status_r
        self._code: int | None = None
        self._lock = threading.Lock()  # the watcher thread waits while check() polls

    def _poll(self, timeout_s: float | None) -> int | None:
        """The exit code, waiting up to ``timeout_s`` (None: until it ends)."""
        if self._code is None:
            select.select([self._status], [], [], timeout_s)  # readable once the code is written (then at end of file)
            with self._lock:
                if self._code is None and select.select([self._status], [], [], 0)[0]:
                    data = os.read(self._status, forkserver.PID.size)
                    # nothing written: the forkserver died before its child, which may run on
                    self._code = forkserver.PID.unpack(data)[0] if len(data) == forkserver.PID.size else -1
        return self._code

    def __del__(self):
        try:
            os.close(self._status)
        except (AttributeError, OSError):
            pass

    def exited(self) -> str | None:
        """None while it runs, else how it ended."""
        code = self._poll(0)
        return None if code is None else f"died with exit code {code}"

    def wait(self, timeout_s: float | None = None) -> str | None:
        """Blocks until it ends (or ``timeout_s`` passes: then None); how it ended."""
        self._poll(timeout_s)
        return self.exited()

    def stop(self, timeout_s: float) -> None:
        """After "close": wait ``timeout_s``, then kill."""
        if self._poll(timeout_s) is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._poll(5)


class TPRankActor:
    """A rank > 0 as a Ray actor (``ray.remote`` is applied by ActorRanks, so this module
    imports without Ray)."""

    def run(self, address: bytes, token: bytes, rank: int, rank0_pid: int) -> str | None:
        """Connect to rank 0, prove ``token``, then serve as rank ``rank`` until closed.
        Returns the error that ended it, or None."""
        import logging

        from pdserve.engine.tensor_parallel.rank import worker_main

        logging.basicConfig(level=logging.INFO)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(60)
        sock.connect(address)
        sock.sendall(token + rank.to_bytes(2, "little"))
        sock.settimeout(None)
        return worker_main(Connection(sock.detach()), rank, rank0_pid)


class ActorRank:
    """Rank ``rank`` as a running TPRankActor: its actor, its run() call and its connection.
    ``wait`` (rank 0's watcher thread) records how it ended; ``exited`` reads that record,
    so a step's check makes no Ray call."""

    def __init__(self, actor, ref):
        self.actor, self.ref = actor, ref
        self.conn: Connection | None = None
        self.pid: int | None = None
        self.ended: str | None = None

    def exited(self) -> str | None:
        return self.ended

    def probe(self) -> str | None:
        """How it ended, asking Ray now (while it starts); None while it runs."""
        import ray

        done, _ = ray.wait([self.ref], timeout=0)
        return self._how() if done else None

    def wait(self) -> str:
        import ray

        while not ray.wait([self.ref], timeout=3600)[0]:  # ray.wait(timeout=None) gives up after 10**6 s
            pass
        self.ended = self._how()
        return self.ended

    def _how(self) -> str:
        import ray

        try:
            detail = ray.get(self.ref, timeout=10)
            return f"ended: {detail}" if detail else "actor ended"
        except Exception as e:  # noqa: BLE001 - RayActorError, RayTaskError: how it ended
            return f"actor died: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def stop(self, timeout_s: float) -> None:
        """After "close": wait ``timeout_s`` for run() to return, then end the actor either way
        (its process holds the shared mappings and its bundle until then)."""
        import ray

        ray.wait([self.ref], timeout=timeout_s)
        ray.kill(self.actor)


def current_placement_group(world: int):
    """The Ray placement group rank 0 runs in, if it is STRICT_PACK with a bundle for each of
    ``world`` ranks (on Linux); else None. Never imports or starts Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized() or not sys.platform.startswith("linux"):  # abstract Unix sockets: Linux's
        return None
    from ray.util.placement_group import get_current_placement_group, placement_group_table

    pg = get_current_placement_group()
    if pg is None or len(pg.bundle_specs) < world:
        return None
    if placement_group_table(pg).get("strategy") != "STRICT_PACK":  # ranks must share rank 0's node (memory, sockets)
        log.warning("tensor parallel: placement group %s is not STRICT_PACK; ranks run as child processes", pg.id.hex())
        return None
    return pg


def start_actors(pg, world: int, timeout_s: float) -> list[ActorRank]:
    """Ranks 1 .. world-1 as actors in bundles 1 .. world-1 of ``pg``, each connected. Raises
    RuntimeError naming a rank whose actor failed, TimeoutError."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    address = f"\0pdserve-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}".encode()
    token = secrets.token_bytes(32)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(world)
    server.settimeout(POLL_S)
    remote = ray.remote(TPRankActor)
    ranks: dict[int, ActorRank] = {}
    try:
        for rank in range(1, world):
            bundle = dict(pg.bundle_specs[rank])
            actor = remote.options(num_cpus=bundle.pop("CPU", 0), num_gpus=bundle.pop("GPU", 0), memory=bundle.pop("memory", None),
                                   resources=bundle, name=None, max_restarts=0, max_concurrency=1,
                                   scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)).remote()
            ranks[rank] = ActorRank(actor, actor.run.remote(address, token, rank, os.getpid()))
        deadline = time.monotonic() + timeout_s
        while any(r.conn is None for r in ranks.values()):
            for rank, r in ranks.items():
                if r.conn is None and (how := r.probe()):
                    raise RuntimeError(f"tensor parallel rank {rank} failed to start: {how}")
            if time.monotonic() > deadline:
                waiting = [rank for rank, r in ranks.items() if r.conn is None]
                raise TimeoutError(f"tensor parallel ranks {waiting} did not connect in {timeout_s:.0f} s (placement group bundles free?)")
            try:
                sock, _ = server.accept()
            except socket.timeout:
                continue
            hello = _recv_exact(sock, HELLO_BYTES, min(HELLO_TIMEOUT_S, max(deadline - time.monotonic(), 0.1)))
            rank = int.from_bytes(hello[32:], "little")
            if len(hello) != HELLO_BYTES or not hmac.compare_digest(hello[:32], token) or rank not in ranks or ranks[rank].conn is not None:
                sock.close()  # not one of ours
                continue
            sock.settimeout(None)
            ranks[rank].conn = Connection(sock.detach())
    except BaseException:
        for r in ranks.values():
            ray.kill(r.actor)
            if r.conn is not None:
                r.conn.close()
        raise
    finally:
        server.close()
    return [ranks[rank] for rank in range(1, world)]
