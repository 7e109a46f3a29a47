"""The `pdserve` command as a user runs it: up -> generate -> down, on a real local Ray cluster."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

GRPC_PORT, HTTP_PORT = 9120, 8120


def pdserve(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    exe = shutil.which("pdserve", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}  # pdserve up's own default, not the tests'
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, env=env)


def niceness_by_process(prefixes: tuple[str, ...]) -> dict[str, set[int]]:
    """The nice values of every thread of the processes whose title starts with each prefix."""
    from pathlib import Path

    found: dict[str, set[int]] = {}
    for proc in Path("/proc").iterdir():
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, ValueError):
            continue
        for prefix in prefixes:
            if title.startswith(prefix):
                for task in (proc / "task").iterdir():
                    try:
                        stat = (task / "stat").read_text()
                    except OSError:
                        continue
                    found.setdefault(prefix, set()).add(int(stat[stat.rindex(")") + 2:].split()[16]))  # field 19: nice
    return found


def test_up_generate_down(tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(
        "model:\n  dtype: float32\n"
        f"router:\n  grpc_port: {GRPC_PORT}\n  http_port: {HTTP_PORT}\n"
    )
    up = pdserve("up", str(config))
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert f"gRPC endpoint: 127.0.0.1:{GRPC_PORT}" in up.stdout
        assert "the pools load it in float32\n" in up.stderr  # the dtype is said (settled here when auto)
        # the Ray that `pdserve up` starts runs its workers at nice 0, not Ray's 15 (pdserve/cli.py)
        serving = ("ray::ServeReplica:pdserve:prefill", "ray::ServeReplica:pdserve:decode", "ray::ServeReplica:pdserve:router",
                   "ray::ProxyActor", "ray::ServeController")
        assert niceness_by_process(serving) == {p: {0} for p in serving}

        gen = pdserve("generate", "What is the capital of France?", "--max-tokens", "32")
        assert gen.returncode == 0, gen.stderr[-3000:]
        assert "Paris" in gen.stdout
        assert "TTFT" in gen.stderr and "TPOT" in gen.stderr and "prompt 37 tokens" in gen.stderr

        bad = pdserve("generate", "Hi", "--max-tokens", "0")
        assert bad.returncode == 1 and "INVALID_ARGUMENT: max_tokens must be >= 1" in bad.stderr
    finally:
        down = pdserve("down")
    assert down.returncode == 0, down.stderr[-3000:]
    gone = pdserve("generate", "Hi", "--endpoint", f"127.0.0.1:{GRPC_PORT}")
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr
