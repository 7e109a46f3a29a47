"""Tensor parallelism inside one replica: a model's heads and feed-forward split over ranks on
one node (shard.py), each rank's model over its share (rank_model.py), their collectives
through shared memory (comm.py), ranks 1 .. n-1 started (launch.py: Ray actors or child
processes), run (rank.py) and driven by rank 0 (group.py)."""

from pdserve.engine.tensor_parallel.group import TPGroup, start

__all__ = ["TPGroup", "start"]
