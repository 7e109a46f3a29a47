"""KV-cache transfer from prefill workers to decode workers.

Roles (after vLLM v1's split connector API):
- ``KVSender`` (prefill side): holds a prompt's KV under a lease and serves it.
- ``KVReceiver`` (decode side): fetches it, then acknowledges so the sender frees it.

Backends: ``grpc`` (any node to any node). See ``make_sender`` / ``make_receiver``.
"""

from kv_transfer.base import KVHandle, KVReceiver, KVSender
from kv_transfer.factory import make_receiver, make_sender

__all__ = ["KVHandle", "KVReceiver", "KVSender", "make_receiver", "make_sender"]
