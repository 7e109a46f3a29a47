"""KVServer: the prefill side of every network backend (a KVSender).

It holds each prompt's KV under a lease (LeaseTable) and runs the KVTransfer gRPC service:

- ``Handshake``: swaps KV fingerprints with a decode worker on first contact;
- ``FetchKV``: streams the KV (grpc backend);
- ``DescribeKV``: tells a same-node decode worker where the blocks lie in this worker's
  shared-memory pool (shm backend), and starts checksumming them;
- ``ReleaseKV``: the acknowledgement (or a cancel); after an shm copy it compares the
  receiver's checksums with ours, then frees the blocks.

A stream that outlives its lease is cut with NOT_FOUND: blocks are freed only when a
lease ends, so a lease still held after the last chunk proves no block was reused while
it was read.
"""

from __future__ import annotations

import time
import uuid
from concurrent import futures

import grpc

from kv_transfer import cuda_ipc_backend, shm_backend, wire
from kv_transfer.security import SecretCheck, secure_port
from kv_transfer.base import KVHandle, KVSender, KVSource
from kv_transfer.faults import FaultInjector
from pdserve.kv_fingerprint import KVFingerprint
from kv_transfer.grpc_backend import FRAME_OPTIONS, MAX_MESSAGE_BYTES, iter_chunks
from kv_transfer.lease import LeaseTable
from kv_transfer.progress import KVNotReadyError
from pdserve.errors import PrefillEndedError
from pdserve.rpc import kv_pb2, kv_pb2_grpc


def fingerprint_to_proto(fp: KVFingerprint | None) -> kv_pb2.KVFingerprint:
    return kv_pb2.KVFingerprint(**fp.to_dict()) if fp is not None else kv_pb2.KVFingerprint()


class _Servicer(kv_pb2_grpc.KVTransferServicer):
    def __init__(self, server: "KVServer"):
        self.s = server

    def _held(self, transfer_id: str, context) -> KVSource:
        source = self.s.table.get(transfer_id)
        if source is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no KV held for transfer {transfer_id!r} (released or lease expired)")
        return source

    def _injected_faults(self) -> tuple[bool, bool]:
        """Take the armed faults as the call arrives (so a stalled call cannot take a fault
        armed for a later one) and apply a "timeout" (stall now). Returns (an armed "break"
        should cut this call, an armed "corrupt" should spoil its payload)."""
        stall, broken, corrupt = (self.s.faults.take(kind) for kind in ("timeout", "break", "corrupt"))
        if stall:
            time.sleep(self.s.faults.stall_s)
        return broken, corrupt

    def Handshake(self, request, context):
        return kv_pb2.HandshakeResponse(fingerprint=fingerprint_to_proto(self.s.fingerprint), instance_id=self.s.instance_id)

    def FetchKV(self, request, context):
        source = self._held(request.transfer_id, context)
        broken, corrupt = self._injected_faults()
        chunks = iter_chunks(request.transfer_id, source, self.s.chunk_bytes, self.s.block_size, corrupt,
                             deadline=_deadline(context), alive=context.is_active)
        try:
            header = next(chunks)
            broken_at = min(2, header.header.num_chunks)  # after the header and a chunk, if there are two
            yield header
            for i, message in enumerate(chunks, 1):
                if broken and i == broken_at:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "injected fault: stream broken mid-transfer")
                yield message
        except PrefillEndedError as e:  # layer-wise: the request ended at its first token
            _abort_prefill_ended(context, e)
        except KVNotReadyError as e:  # layer-wise: prefill failed, was preempted, or took too long
            context.abort(grpc.StatusCode.ABORTED, str(e))
        self._held(request.transfer_id, context)  # still held: nothing was reused under the reads

    def DescribeKV(self, request, context):
        source = self._held(request.transfer_id, context)
        kv_cache = getattr(source, "kv_cache", None)
        if kv_cache is None or (kv_cache.shm_path is None and kv_cache.ipc_handles is None):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this prefill worker's KV pool is neither in shared memory nor exportable over CUDA IPC")
        checksums = shm_backend.checksums if kv_cache.shm_path is not None else cuda_ipc_backend.checksums
        broken, corrupt = self._injected_faults()
        if broken:
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected fault: connection broken mid-transfer")
        first_token = 0
        if source.streamed:  # leased while prefill runs: answer once it has ended (no overlap over shm)
            try:
                first_token = source.wait_first_token(_deadline(context), context.is_active)
            except PrefillEndedError as e:
                _abort_prefill_ended(context, e)
            except KVNotReadyError as e:
                context.abort(grpc.StatusCode.ABORTED, str(e))
        block_ids = shm_backend.block_ids(kv_cache, source.block_table, source.num_tokens)
        # checksum our blocks while the receiver copies them (the C call releases the GIL); ReleaseKV compares
        for tid in [t for t in self.s.checksums if self.s.table.get(t) is None]:  # leases that ended unacknowledged
            self.s.checksums.pop(tid, None)
        self.s.checksums[request.transfer_id] = self.s.checksum_pool.submit(
            lambda: [x ^ (corrupt and i == 0) for i, x in enumerate(checksums(kv_cache, block_ids))])
        k_handle, v_handle = kv_cache.ipc_handles or (b"", b"")
        return kv_pb2.DescribeKVResponse(
            shm_path=kv_cache.shm_path or "", cuda_ipc_k=k_handle, cuda_ipc_v=v_handle, pool_num_blocks=kv_cache.num_blocks, block_ids=block_ids,
            num_tokens=source.num_tokens, block_size=kv_cache.block_size,
            layerwise=source.streamed, first_token=first_token,
        )

    def ReleaseKV(self, request, context):
        pending = self.s.checksums.pop(request.transfer_id, None)
        mismatched = -1
        if request.layer_checksums and pending is not None:
            ours = pending.result()  # computed while the lease is still held
            theirs = list(request.layer_checksums)
            mismatched = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), -1 if len(ours) == len(theirs) else 0)
        return kv_pb2.ReleaseKVResponse(released=self.s.table.release(request.transfer_id), mismatched_layer=mismatched)


PREFILL_ENDED = "pdserve-prefill-ended"  # trailing metadata key: the transfer ended with no fault (PrefillEndedError)


def _abort_prefill_ended(context, e: Exception) -> None:
    context.set_trailing_metadata(((PREFILL_ENDED, "1"),))
    context.abort(grpc.StatusCode.CANCELLED, str(e))


def _deadline(context) -> float:
    """The call's gRPC deadline as time.monotonic() (10 minutes if the caller set none)."""
    left = context.time_remaining()
    return time.monotonic() + (left if left is not None else 600.0)


def _register(servicer: _Servicer, server: grpc.Server) -> None:
    """As the generated add_KVTransferServicer_to_server, but FetchKV's chunks go out
    pre-encoded (kv_transfer/wire.py) instead of through SerializeToString."""
    def unary(method, request_cls):
        return grpc.unary_unary_rpc_method_handler(method, request_deserializer=request_cls.FromString,
                                                   response_serializer=lambda m: m.SerializeToString())

    handlers = {
        "Handshake": unary(servicer.Handshake, kv_pb2.HandshakeRequest),
        "DescribeKV": unary(servicer.DescribeKV, kv_pb2.DescribeKVRequest),
        "ReleaseKV": unary(servicer.ReleaseKV, kv_pb2.ReleaseKVRequest),
        "FetchKV": grpc.unary_stream_rpc_method_handler(
            servicer.FetchKV, request_deserializer=kv_pb2.FetchKVRequest.FromString, response_serializer=wire.serialize_response),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.rpc.KVTransfer", handlers),))


class KVServer(KVSender):
    """Serves held KV on ``bind_host`` at a free port (``self.address``).

    ``shm_path``: the sender's pool file when it offers shm (its PagedKVCache was made
    with one); ``cuda_ipc``: whether it offers its GPU pool over CUDA IPC (made with
    ``cuda_ipc=True``). ``max_workers``: KV calls served at once (a layer-wise FetchKV
    holds one for the length of its prompt's prefill). ``fingerprint``: this worker's KVFingerprint (None only in tests of raw
    transfers). ``secret``: every call must carry it (security.kv_secret). ``tls_cert_file``,
    ``tls_key_file``: PEM files to serve TLS with. ``faults``: the FaultInjector tests arm.
    """

    def __init__(self, bind_host: str, chunk_bytes: int = 1 << 20, *, backend: str = "grpc", fingerprint: KVFingerprint | None = None,
                 block_size: int = 0, shm_path: str | None = None, cuda_ipc: bool = False, node_id: str = "", max_workers: int = 128,
                 secret: str | None = None,
                 tls_cert_file: str | None = None, tls_key_file: str | None = None):
        self.table = LeaseTable()
        self.chunk_bytes = chunk_bytes
        self.backend = backend
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.shm_path = shm_path
        self.cuda_ipc = cuda_ipc
        self.node_id = node_id
        self.instance_id = uuid.uuid4().hex
        self.faults = FaultInjector()
        self.checksum_pool = futures.ThreadPoolExecutor(1, thread_name_prefix="kv-checksum")
        self.checksums: dict[str, futures.Future] = {}  # shm transfers described, not yet released
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-server"),
            options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES), *FRAME_OPTIONS],
            interceptors=[SecretCheck(secret)] if secret else None,  # kv_transfer/security.py
        )
        _register(_Servicer(self), self._server)
        port = secure_port(self._server, f"{bind_host}:0", tls_cert_file, tls_key_file)
        if port == 0:
            raise OSError(f"cannot bind the KV server to {bind_host}")
        self.address = f"{bind_host}:{port}"
        self._server.start()

    def put(self, transfer_id: str, source: KVSource, lease_s: float) -> KVHandle:
        if self.faults.take("expire"):
            lease_s = 0.0
        self.table.hold(transfer_id, source, lease_s)
        return KVHandle(self.backend, self.address, transfer_id, source.num_tokens, self.node_id, self.shm_path or "", self.instance_id,
                        self.cuda_ipc)

    def close(self) -> None:
        self._server.stop(grace=None)
        self.table.close()
        self.checksum_pool.shutdown(wait=False, cancel_futures=True)
