"""Child ranks forked from one process that has imported what a rank needs (launch.py ChildRank).

A rank in a fresh interpreter spends 1.7-2.2 s importing torch and the engine before it
reads its plan; a forked one answers in ~0.02 s (EPYC Zen 4, 2026-12-07). An engine outside
Ray starts one per rank > 0, so each process that starts child ranks starts one forkserver,
the first time it needs one: ``python -m pdserve.engine.tensor_parallel.forkserver FD``,
which imports ``rank`` once and then forks a rank per request. It starts no threads of its
own and runs no torch op (so no OpenMP pool is forked; numpy's OpenBLAS thread is fork-safe).
A forked rank is what a fresh one was: it runs ``rank.worker_main`` on its end of rank 0's
socket pair, with rank 0's environment, working directory, stdout and stderr of the moment
it was asked for (sent with the request).

    rank 0 (Forkserver.start)                      forkserver (serve)
    send (rank, rank 0's pid, env, cwd)  ───────►  fork: the child runs worker_main
         + fds [its socket, a status pipe,         ... reaps it (SIGCHLD): its exit code
                stdout, stderr]
    recv the child's pid                 ◄───────      written to the status pipe, closed

The control socket is SOCK_SEQPACKET (one request a message). The forkserver ends when rank
0's process does (its socket closes); ranks watch rank 0 by its pid (worker_main), so they
end with it too.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading

MAX_REQUEST = 1 << 20  # bytes: a request is the pickled environment and a few fields
PID = struct.Struct("<q")


class Forkserver:
    """Rank 0's handle on its process's forkserver (``get()``); thread-safe."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.tensor_parallel.forkserver", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),))
        theirs.close()
        self.sock, self.owner = ours, os.getpid()
        self._lock = threading.Lock()

    def start(self, conn_fd: int, status_fd: int, rank: int) -> int:
        """Fork rank ``rank`` on socket ``conn_fd``; its exit code (as Popen's returncode: -N
        for signal N) goes to pipe ``status_fd`` when it ends. Both fds stay the caller's to
        close. The rank writes to this process's stdout and stderr of now (fds 1 and 2), as a
        child started now would. Returns the rank's pid. Raises RuntimeError if the
        forkserver is gone."""
        request = pickle.dumps((rank, os.getpid(), dict(os.environ), os.getcwd()), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            try:
                socket.send_fds(self.sock, [request], [conn_fd, status_fd, 1, 2])
                reply = self.sock.recv(PID.size)
            except OSError as e:
                raise RuntimeError(f"tensor parallel forkserver (pid {self.proc.pid}) is gone: {e}") from e
        if len(reply) != PID.size:
            raise RuntimeError(f"tensor parallel forkserver (pid {self.proc.pid}) is gone (exit code {self.proc.poll()})")
        return PID.unpack(reply)[0]


_server: Forkserver | None = None
_server_lock = threading.Lock()


def get() -> Forkserver:
    """This process's forkserver, started on first use (and again where the last one died or
    this is a forked child of the process that started it)."""
    global _server
    with _server_lock:
        if _server is None or _server.proc.poll() is not None or _server.owner != os.getpid():
            _server = Forkserver()
        return _server


def _run_rank(conn_fd: int, rank: int, rank0_pid: int, env: dict, cwd: str) -> int:
    """In the forked child: rank 0's environment and directory, then the rank. Its exit code."""
    import logging
    from multiprocessing.connection import Connection

    os.environ.clear()
    os.environ.update(env)
    try:
        os.chdir(cwd)
    except OSError:
        pass
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    from pdserve.engine.tensor_parallel.rank import worker_main

    return 1 if worker_main(Connection(conn_fd), rank, rank0_pid) else 0


def serve(sock: socket.socket) -> None:
    """Fork a rank per request on ``sock`` until it closes; report each child's exit code."""
    import pdserve.engine.tensor_parallel.rank  # noqa: F401 - torch and the engine, imported once for every rank

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select through the wakeup fd
    status: dict[int, int] = {}  # child pid -> its status pipe
    while True:
        try:
            ready = select.select([sock, wake_r], [], [])[0]
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        while status:
            try:
                pid, how = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            fd = status.pop(pid, None)
            if fd is not None:
                try:
                    os.write(fd, PID.pack(os.waitstatus_to_exitcode(how)))
                except OSError:  # rank 0 closed its end: nobody waits for this code
                    pass
                os.close(fd)
        if sock not in ready:
            continue
        try:
            request, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 4)
        except OSError:
            request, fds = b"", []
        if not request:  # rank 0's process is gone
            return
        conn_fd, status_fd, out_fd, err_fd = fds
        rank, rank0_pid, env, cwd = pickle.loads(request)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.dup2(out_fd, 1)
                os.dup2(err_fd, 2)
                for fd in (wake_r, wake_w, status_fd, out_fd, err_fd, *status.values()):
                    os.close(fd)
                sock.close()
                code = _run_rank(conn_fd, rank, rank0_pid, env, cwd)
            except BaseException:  # noqa: BLE001 - said on the rank's stderr; rank 0 sees its exit code
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        for fd in (conn_fd, out_fd, err_fd):
            os.close(fd)
        status[pid] = status_fd
        sock.send(PID.pack(pid))


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
