"""The prefill pool: runs prompts forward, samples the first token, holds KV for decode."""

from prefill_worker.server import PrefillServer

__all__ = ["PrefillServer"]
