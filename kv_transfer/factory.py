"""Pick the KV transfer backend named in cluster.yaml (``kv_transfer.backend``).

- ``grpc``: KV streamed over gRPC; works between any two nodes.
- ``shm``: the prefill pool lives in a shared-memory file and decode copies blocks out
  of it; both workers must be on one node.
- ``cuda_ipc``: the prefill pool is GPU memory exported over CUDA IPC and decode copies
  blocks device to device; both workers on GPUs of one node (kv_transfer/cuda_ipc_backend.py).
- ``auto``: the prefill side offers what its device allows (shm on CPU, cuda_ipc on a GPU
  with cupy) and grpc; each decode worker uses the same-node transport for a sender on its
  own node and grpc otherwise.
- ``loopback``: in one process (tests); not a cluster setting.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import socket
import uuid

from kv_transfer.base import KVReceiver, KVSender
from pdserve.engine import cpu as kernels
from pdserve.config import ConfigError, KVTransferConfig
from pdserve.engine.engine import EngineConfig
from pdserve.engine.kv_cache import PoolMemory
from pdserve.kv_fingerprint import KVFingerprint
from pdserve.kv_layout import KVSpec

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "pdserve-kv-"


def node_id() -> str:
    """This node's id: Ray's node id inside Ray, else the host name and boot id."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside a Ray worker
        pass
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def remove_stale_pool_files() -> None:
    """Pool files whose prefill process is gone (killed before it could unlink them)."""
    for path in glob.glob(os.path.join(SHM_DIR, SHM_PREFIX + "*")):
        try:
            pid = int(os.path.basename(path)[len(SHM_PREFIX):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
                log.warning("removed stale KV pool file %s", path)
            except OSError:
                pass
        except (ValueError, PermissionError):
            pass


def shm_pool_path(cfg: KVTransferConfig, pool_bytes: int) -> str | None:
    """Where a prefill worker should put its KV pool: a new /dev/shm file name for ``shm``
    and ``auto`` (when shared memory has room), None to keep it private.

    Raises ValueError for ``shm`` when /dev/shm cannot hold ``pool_bytes``.
    """
    from kv_transfer import shm_backend

    if cfg.backend not in ("shm", "auto"):
        return None
    remove_stale_pool_files()
    free = shutil.disk_usage(SHM_DIR).free if os.path.isdir(SHM_DIR) else 0
    problem = None
    if free < pool_bytes * 1.1:
        problem = f"{SHM_DIR} has {free / 1e9:.1f} GB free, the KV pool needs {pool_bytes / 1e9:.1f} GB"
    elif not shm_backend.available():
        problem = f"the shm block copies are unavailable ({kernels.problem('kv_blocks')})"
    if problem is None:
        return os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    if cfg.backend == "shm":
        raise ValueError(f"kv_transfer.backend shm: {problem}")
    log.warning("kv_transfer.backend auto: %s; KV goes over grpc only", problem)
    return None


def prefill_pool_memory(cfg: KVTransferConfig, device: str, spec: KVSpec, config: EngineConfig) -> tuple[PoolMemory | None, str]:
    """The memory a prefill worker's KV pool lives in, so that a decode worker on the same node
    can read it (``pdserve.worker.build_engine``'s ``kv_memory`` hook): exportable GPU memory
    for ``cuda_ipc``/``auto`` on a GPU with cupy, a /dev/shm file for ``shm``/``auto`` on a CPU,
    else None (private memory). ``device``: "cpu" or "cuda". Returns (memory or None, where it
    is, for the log). Raises ConfigError for ``cuda_ipc`` without cupy, or ``shm`` when
    /dev/shm cannot hold the pool or the block-copy kernels do not build."""
    if device == "cuda" and cfg.backend in ("cuda_ipc", "auto"):
        from kv_transfer import cuda_ipc_backend

        if cuda_ipc_backend.available():
            return cuda_ipc_backend.CudaIpcPoolMemory(), "exportable GPU memory (cuda_ipc)"
        if cfg.backend == "cuda_ipc":
            raise ConfigError("kv_transfer.backend cuda_ipc needs cupy: pip install 'pdserve[gpu]'")
    if device == "cpu":
        try:
            path = shm_pool_path(cfg, config.num_blocks * config.block_size * spec.bytes_per_token)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if path is not None:
            from kv_transfer.shm_backend import ShmPoolMemory

            return ShmPoolMemory(path, spec, config.num_blocks, config.block_size), path
    return None, f"private {device} memory"


def make_sender(cfg: KVTransferConfig, node_ip: str, *, fingerprint: KVFingerprint | None = None,
                block_size: int = 0, shm_path: str | None = None, cuda_ipc: bool = False, secret: str | None = None) -> KVSender:
    """``cuda_ipc``: the sender's GPU pool is exportable (PagedKVCache.ipc_handles). Raises
    ValueError for an unknown backend."""
    if cfg.backend == "loopback":
        from kv_transfer.loopback import LoopbackKVSender

        return LoopbackKVSender(fingerprint)
    if cfg.backend in ("grpc", "shm", "cuda_ipc", "auto"):
        from kv_transfer.server import KVServer

        return KVServer(cfg.bind_host or node_ip, cfg.chunk_bytes, backend=cfg.backend, fingerprint=fingerprint,
                        block_size=block_size, shm_path=shm_path, cuda_ipc=cuda_ipc, node_id=node_id(), secret=secret,
                        tls_cert_file=cfg.tls_cert_file, tls_key_file=cfg.tls_key_file)
    raise ValueError(f"unknown KV transfer backend {cfg.backend!r}")


def make_receiver(cfg: KVTransferConfig, *, fingerprint: KVFingerprint | None = None, secret: str | None = None) -> KVReceiver:
    """Raises ValueError for an unknown backend."""
    if cfg.backend == "loopback":
        from kv_transfer.loopback import LoopbackKVReceiver

        return LoopbackKVReceiver(fingerprint)
    if cfg.backend in ("grpc", "shm", "cuda_ipc", "auto"):
        from kv_transfer.client import KVClient

        return KVClient(cfg.backend, fingerprint, node_id(), secret, cfg.tls_ca_file, cfg.tls_server_name)
    raise ValueError(f"unknown KV transfer backend {cfg.backend!r}")
