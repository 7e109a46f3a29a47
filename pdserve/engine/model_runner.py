"""ModelRunner: one step's batch through the model, on the engine's compute backend.

All scheduled sequences go through one forward as a packed batch of N new tokens (no
padding): the backend's ``prepare`` builds the step's metadata once, and every layer's
attention reads each sequence's context from the paged pool. Decode steps that CUDA graphs
can take replay from them (cuda_graphs.py).
"""

from __future__ import annotations

import torch

from pdserve.engine.backends.base import Backend
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model, backend: Backend, graphs: DecodeGraphs | None = None, tp=None):
        """model: pdserve's model over ``backend`` (engine/models/); graphs: run the decode
        steps they can take from CUDA graphs; tp: the tensor-parallel group whose other ranks
        run each step's metadata too (tensor_parallel/group.py), or None."""
        self.model = model
        self.backend = backend
        self.graphs = graphs
        self.tp = tp

    @torch.inference_mode()
    def forward(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run one step over (sequence, new tokens) pairs; returns logits [len(batch), vocab]
        at each sequence's last new token, on the model's device, where the sampler runs
        (sampler.py; a graph's output buffer, valid until the next step)."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.forward(batch)
        meta = self.backend.prepare(batch)
        if self.tp is not None:
            self.tp.broadcast(meta)
        return self.model.forward(meta)
