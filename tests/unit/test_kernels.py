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


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_thread_count_gives_the_same_bits(dtype):
    """The linear layers (split by column panels and, where panels are few, row blocks), the
    row ops and attention (split by query blocks) on 1-4 threads, threads taking chunks in
    whatever order they come: each output is computed by one thread in one fixed order, so
    the bits never change. Shapes with few panels (576 outputs: 9) and many rows take the
    row split; 1 and 5 rows do not. On AMX, 300 and 601 rows split the panels (fewer than two
    row chunks a thread) and 1,100 rows split into row chunks on 2 threads."""
    require_kernels(*ops.KERNELS)
    g = torch.Generator().manual_seed(3)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    w, b, norm_w = rnd(576, 200), rnd(576), rnd(576)
    packed = ops.pack(w)
    heads, kv_heads, D, bs = 6, 2, 64, 16
    k_cache, v_cache = rnd(kv_heads, 40 * bs, D), rnd(kv_heads, 40 * bs, D)
    table = torch.randperm(40, generator=g).to(torch.int32)[None]
    cos, sin = torch.rand(600, D, generator=g), torch.rand(600, D, generator=g)
    for rows in (1, 5, 300, 601, 1100):
        x, res, gu = rnd(rows, 200), rnd(rows, 576), rnd(rows, 2 * 576)
        q = rnd(rows, heads, D)
        pos = torch.arange(rows) if rows <= 600 else torch.arange(rows) % 600

        def run(threads):
            r = res.clone()
            normed = ops.add_rmsnorm(ops.linear(x, packed, 576, b, threads), r, True, norm_w, 1e-5, threads)
            rot = q.clone()
            ops.rope_(rot, pos, cos, sin, threads)
            n = min(rows, 600)
            attn = ops.paged_attention(rot[:n], k_cache, v_cache, table, torch.zeros(n, dtype=torch.int32), torch.arange(n), bs, D ** -0.5,
                                       threads)
            return [normed, r, rot, attn, ops.silu_mul(gu, threads)]

        one = run(1)
        for threads in (2, 3, 4):
            for name, a, c in zip(("linear + norm", "residual", "rope", "attention", "silu_mul"), one, run(threads)):
                assert torch.equal(_bits(a), _bits(c)), f"{name}, {rows} rows, {threads} threads"


def test_the_gate_up_projection_with_silu_gives_the_bits_of_its_two_kernels():
    """linear.c's linear_silu_bf16 (AMX: the gate and up panels summed together, silu(gate) *
    up applied as they are stored) against the gate-up linear then silu_mul: the same bits, for
    1 to 1,100 rows (one block, partial blocks, a panel split and a row split), 1-3 threads,
    with and without a bias."""
    require_kernels("linear", "pointwise")
    if ops.isa(torch.bfloat16) != "amx_bf16":
        pytest.skip("the fused gate-up projection runs on AMX tiles only; elsewhere the decoder calls the two kernels")
    g = torch.Generator().manual_seed(5)
    rnd = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    K, I = 200, 96
    w, b = rnd(2 * I, K), rnd(2 * I)
    packed = ops.pack(w)
    for rows in (1, 17, 33, 300, 1100):
        x = rnd(rows, K) * 3
        for bias in (None, b):
            ref = ops.silu_mul(ops.linear(x, packed, 2 * I, bias, 1), 1)
            for threads in (1, 2, 3):
                got = ops.linear_silu(x, packed, I, bias, threads)
                assert torch.equal(_bits(got), _bits(ref)), f"{rows} rows, {threads} threads, bias {bias is not None}"
    assert ops.linear_silu(rnd(4, K), ops.pack(rnd(2 * 40, K)), 40) is None  # I % 32 != 0: declined, nothing written
