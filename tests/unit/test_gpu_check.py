"""scripts/gpu_check.sh cannot trip on packaging: every module it imports (tests/gpu/test_gpu.py
but its cluster test, which needs Ray and is not run there; bench/engine.py) comes from the
standard library, the GPU image (GPU_IMAGE: a CUDA torch, cupy, transformers and what they
pull in), this repository, or a wheel scripts/gpu_wheels.txt lists, which the script
installs. A dry run imports them all in a fresh interpreter where every other installed top-level
module is absent (``sys.modules[name] = None``: an import of it fails, and
``importlib.util.find_spec`` reports it missing, as an optional import probes)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the GPU image's packages (a CUDA torch, cupy-cuda13x, transformers): these with what they
# require (``image_modules``: their requirements as installed here, without extras)
GPU_IMAGE = ("torch", "transformers", "cupy-cuda13x")
GPU_ONLY = {"cupy", "cupyx", "cupy_backends", "fastrlock", "triton", "nvidia"}  # not installed on a CPU machine
PROJECT = {"pdserve", "kv_transfer", "prefill_worker", "decode_worker", "router", "bench", "conftest", "test_engine", "test_gpu"}
# imported only on paths gpu_check.sh does not take: the cluster test's Ray (deselected with
# -k "not cluster") and bench/engine.py's plot (--no-plot)
NOT_RUN_THERE = {"ray", "matplotlib"}


def image_modules() -> set[str]:
    """Top-level modules of GPU_IMAGE's distributions and everything they require, as installed here."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo, seen = list(GPU_IMAGE), set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:  # cupy, on a CPU machine
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return {module for module, dists in metadata.packages_distributions().items() if any(canonicalize_name(d) in seen for d in dists)} | GPU_ONLY


def wheel_modules() -> dict[str, list[str]]:
    """scripts/gpu_wheels.txt: requirement -> the modules it provides."""
    out = {}
    for line in (ROOT / "scripts" / "gpu_wheels.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement, *modules = line.split()
            out[requirement] = modules
    return out


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            names.add(node.module)
    return {n for n in names if n.split(".")[0] not in NOT_RUN_THERE}


def test_the_wheels_are_pinned_and_each_names_what_it_provides():
    wheels = wheel_modules()
    assert {r.split("==")[0] for r in wheels} >= {"grpcio", "protobuf", "xxhash", "pytest"}
    assert all("==" in r and modules for r, modules in wheels.items())


def test_the_gpu_checks_imports_resolve_from_the_image_the_wheels_and_the_repository():
    allowed = image_modules() | PROJECT | {m.split(".")[0] for modules in wheel_modules().values() for m in modules}
    modules = sorted(imported_modules(ROOT / "tests" / "gpu" / "test_gpu.py") | imported_modules(ROOT / "bench" / "engine.py"))
    script = f"""
import importlib, pkgutil, sys
ALLOWED = {sorted(allowed)!r}
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}, {str(ROOT / "tests" / "unit")!r}, {str(ROOT / "tests" / "gpu")!r}]
for found in pkgutil.iter_modules():  # installed here, absent there: absent here too (an import fails, find_spec says None)
    if found.name not in sys.stdlib_module_names and found.name not in ALLOWED:
        sys.modules[found.name] = None
for name in {modules!r}:
    importlib.import_module(name)
print("ok", len({modules!r}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]
