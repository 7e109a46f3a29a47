"""cuda_ipc backend: same node, GPU to GPU, through CUDA IPC memory handles (cupy).

The shape of the shm backend, on GPU memory:

1. A prefill worker on a GPU allocates its KV pool's k and v as one cudaMalloc each,
   through cupy (``CudaIpcPoolMemory``, the engine's PoolMemory), so each can be exported: cudaIpcGetMemHandle gives
   a 64-byte handle per allocation. ``DescribeKV`` returns both handles with the
   transfer's block ids; the sender starts checksumming those blocks on its GPU.
2. The decode worker opens each sender's handles once (cudaIpcOpenMemHandle, cached per
   sender process, peer access enabled lazily when the two pools sit on different GPUs),
   views them as the sender's pool, and copies the transfer's whole blocks device to
   device into its own blocks: one indexed copy per layer for k and one for v.
3. It checksums its copy, every layer in one computation on its GPU and one copy of the
   sums to the host, and acknowledges with ``ReleaseKV``; the sender compares (as shm
   does), so a copy that raced a reused block is caught.

cupy comes with the ``gpu`` extra (``pip install 'pdserve[gpu]'``, cupy-cuda12x; ``gpu-cuda13``
for cupy-cuda13x: any cupy build works). CUDA
runtime IPC: https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__DEVICE.html
(cudaIpcGetMemHandle, cudaIpcOpenMemHandle); cupy: ``cupy.cuda.runtime``.

Not yet run on a GPU: written in a session without one; tests/gpu/test_gpu.py checks it.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

from kv_transfer.base import KVSink
from pdserve.engine.kv_cache import PagedKVCache, PoolMemory
from pdserve.errors import KVTransferError

_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


def available() -> bool:
    """Whether this process can use cuda_ipc: a CUDA device and cupy."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def _as_torch(cupy_mod, ptr: int, nbytes: int, owner, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch view of ``nbytes`` of device memory at ``ptr`` (kept alive by ``owner``)."""
    memory = cupy_mod.cuda.UnownedMemory(ptr, nbytes, owner)
    array = cupy_mod.ndarray((nbytes,), dtype=cupy_mod.uint8, memptr=cupy_mod.cuda.MemoryPointer(memory, 0))
    return torch.from_dlpack(array).view(dtype).view(shape)  # cupy has no bfloat16: bytes, then torch's view


def exportable_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, bytes]:
    """A zeroed tensor in its own cudaMalloc allocation, and that allocation's IPC handle.
    Raises ImportError without cupy."""
    import cupy

    nbytes = math.prod(shape) * dtype.itemsize
    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        memory = cupy.cuda.Memory(nbytes)  # a plain cudaMalloc: the handle covers exactly this pool
        tensor = _as_torch(cupy, memory.ptr, nbytes, memory, dtype, shape)
        tensor.zero_()
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(memory.ptr))
    return tensor, handle


class CudaIpcPoolMemory(PoolMemory):
    """A GPU KV pool whose k and v are each one cudaMalloc allocation, exportable over CUDA
    IPC (``ipc_handles``). Its ``allocate`` raises ImportError without cupy."""

    def allocate(self, shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        (k, hk), (v, hv) = (exportable_zeros(shape, dtype, device) for _ in range(2))
        self.ipc_handles = (hk, hv)
        return k, v


_WEIGHT_PERIOD = 65521  # position weights 1 .. 65521 (a prime), so a moved or swapped word changes the sum


def layer_checksums(k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Checksums of a transfer's blocks in every layer, on the pool's device, with no host
    sync: k, v: [num_layers, kv_heads, num_slots, head_dim]; block_ids: int64 [n] on the same
    device. Returns int64 [num_layers]: per layer, sum over k's then v's 32-bit words (16-bit
    where a block's bytes are not a multiple of 4) of word * (position % 65521 + 1), in int64
    arithmetic, which wraps the same on any device and in any order, so both sides agree bit
    for bit; the sign bit cleared (a protobuf fixed64)."""
    num_layers, heads, num_slots, head_dim = k.shape
    row_bytes = block_size * head_dim * k.element_size()
    word = torch.int32 if row_bytes % 4 == 0 else torch.int16
    out = torch.empty(num_layers, dtype=torch.int64, device=k.device)
    weights = None
    for layer in range(num_layers):  # a layer at a time: the int64 words of one layer's blocks at most, not the transfer's
        sums = []
        for t in (k[layer], v[layer]):
            blocks = t.view(heads, num_slots // block_size, block_size * head_dim)[:, block_ids]  # [H, n, bs * D]
            words = blocks.contiguous().view(-1).view(word)
            if weights is None:
                weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % _WEIGHT_PERIOD + 1
            sums.append((words.to(torch.int64) * weights).sum())
        out[layer] = sums[0] * 1_000_003 + sums[1]
    return out & ((1 << 63) - 1)


def checksums(kv_cache: PagedKVCache, ids: list[int]) -> list[int]:
    """The sender's per-layer checksums of a transfer's blocks (run beside the copy): one
    device computation, one copy to the host."""
    index = torch.tensor(ids, dtype=torch.long, device=kv_cache.device)
    return layer_checksums(kv_cache.k, kv_cache.v, index, kv_cache.block_size).tolist()


class CudaIpcUnavailable(KVTransferError):
    """This process cannot map a sender's pool (no cupy, or the CUDA runtime refuses the
    handle): the receiver in ``auto`` mode takes the grpc stream from that sender instead."""


class CudaIpcReader:
    """Receiver side: opens senders' pools (a few at a time) and copies blocks out of them."""

    def __init__(self, max_open: int = 8):
        self._pools: OrderedDict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._max_open = max_open
        self._lock = threading.Lock()

    def _open(self, key: tuple[str, str], desc, sink: KVSink, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if key not in self._pools:
                try:
                    import cupy
                except ImportError:
                    raise CudaIpcUnavailable("cupy is not installed in the decode worker") from None

                spec = sink.spec
                shape = (spec.num_layers, spec.num_kv_heads, desc.pool_num_blocks * desc.block_size, spec.head_dim)
                nbytes = math.prod(shape) * spec.dtype.itemsize
                pools = []
                try:
                    with cupy.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()):
                        for handle in (desc.cuda_ipc_k, desc.cuda_ipc_v):
                            ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle, _LAZY_PEER_ACCESS)
                            pools.append(_as_torch(cupy, ptr, nbytes, _Opened(ptr), spec.dtype, shape))
                except Exception as e:  # noqa: BLE001 - cupy raises its own CUDARuntimeError
                    # e.g. each Ray actor sees only its own GPU (CUDA_VISIBLE_DEVICES) and the runtime will not map another's
                    raise CudaIpcUnavailable(f"cannot open the sender's KV pool over CUDA IPC: {e}") from None
                self._pools[key] = (pools[0], pools[1])
                while len(self._pools) > self._max_open:  # the oldest sender's mapping goes (closed when unreferenced)
                    self._pools.popitem(last=False)
            self._pools.move_to_end(key)
            return self._pools[key]

    def copy(self, desc, key: tuple[str, str], sink: KVSink, cancel: threading.Event | None) -> tuple[int, list[int]]:
        """Copy a described transfer (DescribeKVResponse) into ``sink``, a PagedKVSink on a
        GPU with the sender's block size; returns (bytes copied, per-layer checksums).
        ``key``: (sender address, sender instance id), under which its pool stays open.

        Raises KVTransferError on a bad description, a sink not on a GPU, or a cancel.
        """
        paged = getattr(sink, "kv_cache", None)
        if paged is None or paged.device.type != "cuda" or paged.block_size != desc.block_size:
            raise KVTransferError("cuda_ipc needs the decode worker's KV pool on a GPU, with the sender's block size")
        spec, block_size = sink.spec, desc.block_size
        if block_size < 1 or len(desc.block_ids) * block_size < desc.num_tokens:
            raise KVTransferError("cuda_ipc KV description does not match this decode worker's layout")
        src_k, src_v = self._open(key, desc, sink, paged.device)
        src_ids = torch.tensor(list(desc.block_ids), dtype=torch.long, device=paged.device)
        dst_ids = torch.tensor(sink.block_table[: len(src_ids)], dtype=torch.long, device=paged.device)
        nbytes = 0
        blocks = lambda t: t.view(spec.num_kv_heads, -1, block_size * spec.head_dim)  # noqa: E731 - [kv_heads, blocks, block_size * head_dim]
        for layer in range(spec.num_layers):
            if cancel is not None and cancel.is_set():
                raise KVTransferError("KV transfer cancelled")
            for src, dst in ((src_k[layer], paged.k[layer]), (src_v[layer], paged.v[layer])):
                blocks(dst)[:, dst_ids] = blocks(src)[:, src_ids]  # whole blocks, device to device
            nbytes += 2 * desc.num_tokens * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
        # every layer's checksum on the GPU, then one copy to the host (after the copies, on one stream)
        return nbytes, layer_checksums(paged.k, paged.v, dst_ids, block_size).tolist()


class _Opened:
    """Owner of an opened IPC mapping: closes it when the last view is gone."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __del__(self):
        try:
            import cupy

            cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)
        except Exception:  # noqa: BLE001 - interpreter shutdown, or already closed
            pass
