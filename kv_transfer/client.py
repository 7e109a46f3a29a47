"""KVClient: the decode side of every network backend (a KVReceiver).

For each handle it (1) handshakes once per sender instance and refuses an incompatible
fingerprint, (2) picks the transport: ``cuda_ipc`` when the sender offers its GPU pool on
this node and this worker's pool is on a GPU too (backend ``cuda_ipc`` or ``auto``),
``shm`` when the sender offers its pool file on this node (``shm`` or ``auto``), else the
``grpc`` stream, (3) moves and checks the KV, (4) acknowledges with ReleaseKV, which must
find the lease still held.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from kv_transfer import wire
from kv_transfer.security import channel as channel_to
from kv_transfer.security import with_secret
from kv_transfer.base import KVHandle, KVReceiver, KVSink
from pdserve.kv_fingerprint import KVFingerprint
from kv_transfer.grpc_backend import FRAME_OPTIONS, MAX_MESSAGE_BYTES, receive_stream
from kv_transfer.server import PREFILL_ENDED, fingerprint_to_proto
from kv_transfer.cuda_ipc_backend import CudaIpcReader, CudaIpcUnavailable
from kv_transfer.shm_backend import ShmReader
from pdserve.errors import KVAuthError, KVNotFoundError, KVTransferError, PrefillEndedError
from pdserve.rpc import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)


class KVClient(KVReceiver):
    """``mode``: "grpc" (always stream), "shm" or "cuda_ipc" (same node only) or "auto"
    (cuda_ipc, else shm, where it can; a sender whose GPU pool this process cannot map, e.g.
    each Ray actor seeing only its own GPU, is read over grpc from then on, logged once).
    ``secret``: sent as metadata on every KV call (security.kv_secret). ``tls_ca_file``:
    connect with TLS, verifying the server against this CA (``tls_server_name``: the name in
    its certificate, if not the address's host)."""

    def __init__(self, mode: str = "grpc", fingerprint: KVFingerprint | None = None, node_id: str = "", secret: str | None = None,
                 tls_ca_file: str | None = None, tls_server_name: str | None = None):
        if mode not in ("grpc", "shm", "cuda_ipc", "auto"):
            raise ValueError(f"unknown KV receive mode {mode!r}")
        self.mode = mode
        self.fingerprint = fingerprint
        self.node_id = node_id
        self._secret = secret  # sent on every call (security.kv_secret)
        self._tls = (tls_ca_file, tls_server_name)  # TLS verified against this CA, when set
        self._stubs: dict[str, kv_pb2_grpc.KVTransferStub] = {}
        self._channels: list[grpc.Channel] = []
        self._verified: set[tuple[str, str]] = set()  # (address, instance_id) with a matching fingerprint
        self._lock = threading.Lock()
        self._shm = ShmReader()
        self._cuda = CudaIpcReader()
        self._no_ipc: dict[tuple[str, str], str] = {}  # (address, instance id) -> why its pool cannot be mapped here
        self._stats: dict[str, float] = {"num_fetched": 0, "bytes_fetched": 0, "fetch_seconds": 0.0}

    def _stub(self, address: str) -> kv_pb2_grpc.KVTransferStub:
        with self._lock:
            if address not in self._stubs:
                raw = channel_to(address, [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *FRAME_OPTIONS], *self._tls)
                self._channels.append(raw)
                channel = with_secret(raw, self._secret)
                stub = kv_pb2_grpc.KVTransferStub(channel)
                # chunks decode into views of the received bytes (kv_transfer/wire.py)
                stub.FetchKV = channel.unary_stream("/pdserve.rpc.KVTransfer/FetchKV", request_serializer=kv_pb2.FetchKVRequest.SerializeToString,
                                                    response_deserializer=wire.decode_response)
                self._stubs[address] = stub
            return self._stubs[address]

    def _handshake(self, handle: KVHandle, stub, timeout_s: float) -> None:
        key = (handle.address, handle.instance_id)
        if key in self._verified:
            return
        reply = stub.Handshake(kv_pb2.HandshakeRequest(fingerprint=fingerprint_to_proto(self.fingerprint)), timeout=timeout_s)
        if self.fingerprint is not None:
            theirs = KVFingerprint.from_dict({f: getattr(reply.fingerprint, f) for f in self.fingerprint.to_dict()})
            self.fingerprint.check(theirs, f"prefill worker {handle.address}")
        with self._lock:
            self._verified.add((handle.address, reply.instance_id))

    def transport_for(self, handle: KVHandle, device: str = "cpu") -> str:
        """"cuda_ipc", "shm" or "grpc" for this handle and a receiving pool on ``device``
        ("cpu" or "cuda"). Raises KVTransferError if shm or cuda_ipc is required but impossible."""
        node = handle.node_id == self.node_id
        cuda = node and handle.cuda_ipc and device == "cuda"
        shm = node and bool(handle.shm_path) and device == "cpu"
        if self.mode == "auto":
            cuda = cuda and (handle.address, handle.instance_id) not in self._no_ipc
            return "cuda_ipc" if cuda else "shm" if shm else "grpc"
        if self.mode == "grpc" or (self.mode == "cuda_ipc" and cuda) or (self.mode == "shm" and shm):
            return self.mode
        why = "another node" if not node else f"no {'GPU' if self.mode == 'cuda_ipc' else 'shared-memory'} pool on both sides"
        raise KVTransferError(f"kv_transfer.backend is {self.mode} but the prefill worker at {handle.address} ({why}) cannot share memory with this one")

    def fetch(self, handle: KVHandle, sink: KVSink, timeout_s: float, cancel: threading.Event | None = None) -> str:
        deadline = time.monotonic() + timeout_s
        left = lambda: max(0.001, deadline - time.monotonic())  # noqa: E731
        stub = self._stub(handle.address)
        start = time.perf_counter()
        try:
            self._handshake(handle, stub, left())
            paged = getattr(sink, "kv_cache", None)
            transport = self.transport_for(handle, paged.device.type if paged is not None else "cpu")
            sums: list[int] = []
            if transport == "cuda_ipc":
                desc = stub.DescribeKV(kv_pb2.DescribeKVRequest(transfer_id=handle.transfer_id), timeout=left())
                try:
                    nbytes, sums = self._cuda.copy(desc, (handle.address, handle.instance_id), sink, cancel)
                    if desc.layerwise:
                        sink.first_token = desc.first_token
                except CudaIpcUnavailable as e:
                    if self.mode != "auto":
                        raise
                    self._no_ipc[(handle.address, handle.instance_id)] = str(e)  # from now on: grpc from this sender
                    log.warning("KV from %s comes over grpc, not cuda_ipc: %s", handle.address, e)
                    transport = "grpc"
            if transport == "shm":
                desc = stub.DescribeKV(kv_pb2.DescribeKVRequest(transfer_id=handle.transfer_id), timeout=left())
                nbytes, sums = self._shm.copy(desc, sink, cancel)
                if desc.layerwise:  # leased while prefill ran: DescribeKV answered once it ended
                    sink.first_token = desc.first_token
            elif transport == "grpc":
                stream = stub.FetchKV(kv_pb2.FetchKVRequest(transfer_id=handle.transfer_id), timeout=left())
                done = threading.Event()
                if cancel is not None:  # a cancel cuts the stream at once, even while it waits
                    threading.Thread(target=_cancel_when, args=(cancel, done, stream.cancel), daemon=True).start()
                try:
                    nbytes = receive_stream(stream, handle, sink, cancel)
                finally:
                    done.set()
                    stream.cancel()
            ack = stub.ReleaseKV(kv_pb2.ReleaseKVRequest(transfer_id=handle.transfer_id, layer_checksums=sums), timeout=left())
            if not ack.released:
                raise KVNotFoundError(f"the lease on KV {handle.transfer_id!r} ended before it was acknowledged; what was read may be stale")
            if sums and ack.mismatched_layer >= 0:
                raise KVTransferError(f"KV layer {ack.mismatched_layer} failed its checksum after the {transport} copy")
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise KVNotFoundError(e.details()) from None
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise KVAuthError(f"prefill worker {handle.address} refused this decode worker: {e.details()}") from None
            if cancel is not None and cancel.is_set():
                raise KVTransferError("KV transfer cancelled") from None
            if any(key == PREFILL_ENDED for key, _ in (e.trailing_metadata() or ())):
                raise PrefillEndedError(e.details()) from None  # layer-wise: nothing to decode
            raise KVTransferError(f"KV fetch from {handle.address} failed: {e.code().name}: {e.details()}") from None
        with self._lock:
            self._stats["num_fetched"] += 1
            self._stats["bytes_fetched"] += nbytes
            self._stats["fetch_seconds"] += time.perf_counter() - start
            self._stats[f"num_fetched_{transport}"] = self._stats.get(f"num_fetched_{transport}", 0) + 1
        return transport

    def release(self, handle: KVHandle, timeout_s: float) -> bool:
        try:
            reply = self._stub(handle.address).ReleaseKV(kv_pb2.ReleaseKVRequest(transfer_id=handle.transfer_id), timeout=timeout_s)
        except grpc.RpcError as e:
            raise KVTransferError(f"KV release at {handle.address} failed: {e.code().name}: {e.details()}") from None
        return reply.released

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
            self._stubs.clear()


def _cancel_when(cancel: threading.Event, done: threading.Event, fn) -> None:
    while not done.wait(0.02):
        if cancel.is_set():
            fn()
            return
