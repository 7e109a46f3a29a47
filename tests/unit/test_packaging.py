"""The install layout: our stubs import, and `proto` stays proto-plus's."""

import filecmp
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_import_proto_is_still_proto_plus():
    import proto

    assert Path(proto.__file__).parent.parent.name in ("site-packages", "dist-packages"), proto.__file__
    assert hasattr(proto, "Message"), "`proto` is not proto-plus"


def test_our_stubs_import():
    from pdserve.rpc import generate_pb2, generate_pb2_grpc, kv_pb2, kv_pb2_grpc

    assert generate_pb2.DESCRIPTOR.package == "pdserve.rpc"
    assert hasattr(generate_pb2_grpc, "add_GeneratorServicer_to_server")
    assert hasattr(kv_pb2_grpc, "KVTransferStub")
    assert "KVChunk" in kv_pb2.DESCRIPTOR.message_types_by_name


def test_committed_stubs_match_the_proto_sources(tmp_path):
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is not installed")
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos],
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        assert filecmp.cmp(tmp_path / rel, ROOT / rel, shallow=False), f"{rel} is stale: run scripts/gen_proto.sh"


def test_console_script():
    exe = shutil.which("pdserve", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert exe, "console script `pdserve` is not installed"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("up", "down", "generate"):
        assert command in out


def test_the_client_sdk_and_the_cli_import_without_torch():
    """A client machine needs no torch: ``pdserve.client`` and the CLI (``pdserve generate``,
    ``down``) import none; the commands that load a model import it when they run."""
    code = "import sys, pdserve.client, pdserve_app.cli; print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_bench_is_not_in_the_wheel_and_the_cli_runs_it_from_the_checkout(tmp_path):
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [p for p in include if p.startswith("bench")], include
    exe = shutil.which("pdserve", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([exe, "bench", "serve", "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and "--base-url" in out.stdout, out.stderr[-2000:]
