"""KV-cache transfer from prefill workers to decode workers.

Roles (after vLLM v1's split connector API):
- ``KVSender`` (prefill side): holds a prompt's KV under a lease and serves it.
- ``KVReceiver`` (decode side): fetches it, then acknowledges so the sender frees it.

Backends (``kv_transfer.backend`` in cluster.yaml; see factory.py): ``grpc`` (any node to
any node), ``shm`` (same node, from the prefill pool's shared memory into decode's
blocks), ``cuda_ipc`` (same node, GPU pool to GPU pool), ``auto`` (the same-node one where
the peer is on this node, else grpc) and ``loopback`` (in-process, tests). Every payload is
checksummed, peers swap fingerprints first (``pdserve/kv_fingerprint.py``), and the
prefill side holds KV under a lease until acknowledged (lease.py).
"""

from kv_transfer.base import KVHandle, KVReceiver, KVSender
from kv_transfer.factory import make_receiver, make_sender

__all__ = ["KVHandle", "KVReceiver", "KVSender", "make_receiver", "make_sender"]
