"""The C kernels build, load and pass their self-check wherever a C compiler is found: a failed
build fails here with the compiler's message (elsewhere, tests that need a kernel fail the same
way), never a quiet fallback to the torch backend. Without a compiler, the engine's choice
falls back to torch and says so."""

import logging

import pytest
import torch

from conftest import NO_COMPILER, require_kernels
from pdserve.engine import backends, cpu
from pdserve.engine.cpu import ops


@pytest.mark.parametrize("name", sorted(cpu._SIGNATURES))
def test_every_kernel_builds_where_a_compiler_is(name):
    require_kernels(name)
    assert cpu.load(name) is not None and cpu.problem(name) is None


def test_the_engine_takes_the_cpu_backend_where_the_kernels_build():
    require_kernels(*ops.KERNELS)
    for dtype in (torch.float32, torch.bfloat16):
        assert backends.resolve("auto", dtype, torch.device("cpu")) == "cpu"


def test_a_failed_build_reports_the_compilers_message(monkeypatch, tmp_path, caplog):
    """With a compiler that cannot build (a stand-in that prints an error and exits 1), the
    library is None and ``problem`` carries the compiler's own words; nothing is cached."""
    if cpu.compiler() is None:
        pytest.skip(NO_COMPILER)
    bad_cc = tmp_path / "bad-cc"
    bad_cc.write_text("#!/bin/sh\necho 'pointwise.c:1:1: error: this compiler refuses' >&2\nexit 1\n")
    bad_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(bad_cc))
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu, "_libs", {})
    monkeypatch.setattr(cpu, "_problems", {})
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.cpu"):
        assert cpu.load("pointwise") is None
    why = cpu.problem("pointwise")
    assert "this compiler refuses" in why and str(bad_cc) in why
    assert "this compiler refuses" in caplog.text
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))


def test_without_a_compiler_the_problem_says_so(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    monkeypatch.setattr(cpu, "_libs", {})
    monkeypatch.setattr(cpu, "_problems", {})
    assert cpu.compiler() is None
    assert cpu.load("linear") is None and cpu.problem("linear").startswith("no C compiler found")
