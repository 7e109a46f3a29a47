"""Tensor parallelism inside one replica: a model's heads and feed-forward split over ranks on
one node (shard.py), their collectives through shared memory (comm.py), the ranks started and
driven by rank 0 (group.py)."""

from pdserve.engine.tensor_parallel.group import TPGroup, start

__all__ = ["TPGroup", "start"]
