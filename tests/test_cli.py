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
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


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
