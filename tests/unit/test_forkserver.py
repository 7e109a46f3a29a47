"""Child tensor-parallel ranks come from one forkserver per process (engine/tensor_parallel/
forkserver.py): each rank is its child, a rank that fails says why and its exit code reaches
rank 0, a killed one's signal does, and a forkserver that died is replaced at the next start.
(test_tensor_parallel.py runs whole engines on these ranks.)"""

import os
import signal

import psutil
import pytest

from pdserve.engine.tensor_parallel import forkserver
from pdserve.engine.tensor_parallel.launch import ChildRank

DEADLINE_S = 60  # against a hang only


def test_ranks_are_children_of_one_forkserver_and_their_exit_codes_reach_rank_0():
    server = forkserver.get()
    first, second = ChildRank(1), ChildRank(2)
    try:
        assert forkserver.get() is server
        assert {psutil.Process(r.pid).ppid() for r in (first, second)} == {server.proc.pid}
        assert first.exited() is None and second.exited() is None
        first.conn.send_bytes(b"not a plan")  # worker_main reads its plan first: it fails, says why, and exits 1
        assert first.conn.poll(DEADLINE_S)
        what, detail = first.conn.recv()
        assert what == "error" and "UnpicklingError" in detail
        assert first.wait(DEADLINE_S) == "died with exit code 1"
        os.kill(second.pid, signal.SIGKILL)
        assert second.wait(DEADLINE_S) == f"died with exit code -{signal.SIGKILL}"
        assert second.exited() == f"died with exit code -{signal.SIGKILL}"
    finally:
        for r in (first, second):
            r.stop(DEADLINE_S)
            r.conn.close()


def test_a_dead_forkserver_is_replaced_at_the_next_start():
    old = forkserver.get()
    old.proc.kill()
    old.proc.wait(DEADLINE_S)
    rank = ChildRank(1)
    try:
        assert forkserver.get() is not old
        assert psutil.Process(rank.pid).ppid() == forkserver.get().proc.pid
    finally:
        rank.conn.close()  # its plan never comes: the rank ends on the closed connection
        assert rank.wait(DEADLINE_S) is not None


def test_a_forkserver_that_cannot_answer_is_a_runtime_error_naming_it():
    server = forkserver.get()
    server.sock.close()
    try:
        with pytest.raises(RuntimeError, match="tensor parallel forkserver .* is gone"):
            server.start(0, 0, 1)
    finally:
        server.proc.kill()
        server.proc.wait(DEADLINE_S)
