"""loopback backend: sender and receiver in one process (unit tests, tools).

The sender registers itself under an id; the receiver finds it there and copies layer by
layer from the held source into the sink. Leases, fingerprints, cancellation and the
acknowledgement rule are the same as over the network.
"""

from __future__ import annotations

import itertools
import threading
import time

from kv_transfer.base import KVHandle, KVReceiver, KVSender, KVSink, KVSource
from pdserve.kv_fingerprint import KVFingerprint
from kv_transfer.lease import LeaseTable
from pdserve.errors import KVNotFoundError, KVTransferError

_senders: dict[str, "LoopbackKVSender"] = {}
_ids = itertools.count()
_lock = threading.Lock()


class LoopbackKVSender(KVSender):
    def __init__(self, fingerprint: KVFingerprint | None = None):
        self.fingerprint = fingerprint
        self.table = LeaseTable()
        with _lock:
            self.address = f"loopback:{next(_ids)}"
            _senders[self.address] = self

    def put(self, transfer_id: str, source: KVSource, lease_s: float) -> KVHandle:
        self.table.hold(transfer_id, source, lease_s)
        return KVHandle("loopback", self.address, transfer_id, source.num_tokens)

    def close(self) -> None:
        with _lock:
            _senders.pop(self.address, None)
        self.table.close()


class LoopbackKVReceiver(KVReceiver):
    def __init__(self, fingerprint: KVFingerprint | None = None):
        self.fingerprint = fingerprint
        self._stats = {"num_fetched": 0, "bytes_fetched": 0, "fetch_seconds": 0.0}

    def _sender(self, handle: KVHandle) -> LoopbackKVSender:
        sender = _senders.get(handle.address)
        if sender is None:
            raise KVTransferError(f"no loopback KV sender {handle.address} in this process")
        return sender

    def fetch(self, handle: KVHandle, sink: KVSink, timeout_s: float, cancel: threading.Event | None = None) -> str:
        start = time.perf_counter()
        sender = self._sender(handle)
        if self.fingerprint is not None and sender.fingerprint is not None:
            self.fingerprint.check(sender.fingerprint, handle.address)
        source = sender.table.get(handle.transfer_id)
        if source is None:
            raise KVNotFoundError(f"no KV held for transfer {handle.transfer_id!r} (released or lease expired)")
        if source.spec != sink.spec or source.num_tokens != handle.num_tokens:
            raise KVTransferError(f"loopback KV layout {source.spec} x {source.num_tokens} does not match {sink.spec}")
        deadline = time.monotonic() + timeout_s
        alive = (lambda: not cancel.is_set()) if cancel is not None else None
        for layer in range(source.spec.num_layers):
            if cancel is not None and cancel.is_set():
                raise KVTransferError("KV transfer cancelled")
            if time.perf_counter() - start > timeout_s:
                raise KVTransferError(f"KV fetch timed out after {timeout_s} s")
            source.wait_layer(layer, source.num_tokens, deadline, alive)  # layer-wise: each layer once written
            with source.reading():
                k, v = source.read(layer, 0, source.num_tokens)
            sink.write(layer, 0, k, v)
        if source.streamed:
            sink.first_token = source.wait_first_token(deadline, alive)
        if not sender.table.release(handle.transfer_id):
            raise KVNotFoundError(f"the lease on KV {handle.transfer_id!r} ended before it was acknowledged")
        self._stats["num_fetched"] += 1
        self._stats["bytes_fetched"] += source.nbytes
        self._stats["fetch_seconds"] += time.perf_counter() - start
        return "loopback"

    def release(self, handle: KVHandle, timeout_s: float) -> bool:
        return self._sender(handle).release(handle.transfer_id)

    def stats(self) -> dict[str, float]:
        return dict(self._stats)
