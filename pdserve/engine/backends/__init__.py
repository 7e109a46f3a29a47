"""Compute backends by name, and the choice of one (cluster.yaml's ``backend`` key).

- ``cpu``: pdserve's C kernels (engine/cpu/), batch invariant; the default on a CPU where
  they build and pass their self-check;
- ``torch``: plain torch, batch invariant row by row; portable and slow, the fallback;
- ``cuda``: torch batched on a GPU, decode steps CUDA-graph ready; the default on a GPU.
"""

from __future__ import annotations

import logging
import os

import torch

from pdserve.engine.backends import cpu
from pdserve.engine.backends.base import Backend, StepMetadata
from pdserve.engine.backends.cuda import CudaBackend
from pdserve.engine.backends.torch_sdpa import TorchBackend

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[Backend]] = {"cpu": cpu.CpuBackend, "torch": TorchBackend, "cuda": CudaBackend}
CHOICES = ("auto", *BACKENDS)

__all__ = ["BACKENDS", "CHOICES", "Backend", "StepMetadata", "resolve", "select"]

# Tests only: "1" lets ``cuda`` run on the CPU device, so that CI executes its code and checks
# its ids against model.generate (tests/unit/test_cuda_backend_cpu.py). Not a serving mode
# (graphs are never captured there, and CPU sums are not a GPU's) and not documented for users.
TEST_CUDA_ON_CPU_ENV = "PDSERVE_TEST_CUDA_BACKEND_ON_CPU"


def resolve(name: str, dtype: torch.dtype, device: torch.device) -> str:
    """The backend ``name`` ("auto" or one of BACKENDS) means for this dtype and device.
    Raises ValueError for an unknown name, or one that cannot run here (``cpu`` where the
    kernels did not build, ``cuda`` off a GPU but in a test that sets
    TEST_CUDA_ON_CPU_ENV). ``auto`` logs a warning when a CPU falls back
    to ``torch``."""
    if name not in CHOICES:
        raise ValueError(f"backend must be one of {', '.join(CHOICES)}, not {name!r}")
    if name == "auto":
        if device.type == "cuda":
            return "cuda"
        if cpu.supported(dtype, device):
            return "cpu"
        logger.warning("pdserve: the C kernels are unavailable here (see the warning above); steps run on the torch "
                       "backend, batch invariant but several times slower")
        return "torch"
    if name == "cpu" and not cpu.supported(dtype, device):
        raise ValueError(f"backend 'cpu' cannot run here ({dtype} on {device}, or its kernels did not build); use auto or torch")
    if name == "cuda" and device.type != "cuda":
        if os.environ.get(TEST_CUDA_ON_CPU_ENV) != "1":
            raise ValueError(f"backend 'cuda' needs the model on a GPU, not {device}")
        logger.warning("pdserve: the cuda backend runs on %s for a test (%s=1)", device, TEST_CUDA_ON_CPU_ENV)
    return name


def select(name: str, kv_cache, num_threads: int = 1) -> Backend:
    """A backend instance for ``kv_cache``'s dtype and device (``resolve`` for the name)."""
    return BACKENDS[resolve(name, kv_cache.spec.dtype, kv_cache.device)](kv_cache, num_threads)
