"""The decode pool: fetches a prompt's KV from prefill and streams the rest of the answer."""

from decode_worker.server import DecodeServer

__all__ = ["DecodeServer"]
