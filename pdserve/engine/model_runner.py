"""ModelRunner: one step's batch through the model, on the engine's compute backend.

All scheduled sequences go through one forward as a packed batch of N new tokens (no
padding): the backend's ``prepare`` builds the step's metadata once, and every layer's
attention reads each sequence's context from the paged pool. Decode steps that CUDA graphs
can take replay from them (cuda_graphs.py).
"""

from __future__ import annotations

import torch

from pdserve.engine.backends.base import Backend
from pdserve.engine.cuda_graphs import DecodeGraphs, GraphCaptureFailed
from pdserve.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model, backend: Backend, graphs: DecodeGraphs | None = None):
        """model: pdserve's model over ``backend`` (engine/models/); graphs: run the decode
        steps they can take from CUDA graphs."""
        self.model = model
        self.backend = backend
        self.graphs = graphs

    @torch.inference_mode()
    def forward(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run one step over (sequence, new tokens) pairs; returns logits [len(batch), vocab]
        (float32, on the CPU, where sampling runs) at each sequence's last new token."""
        if self.graphs is not None and self.graphs.can_run(batch):
            try:
                return self.graphs.forward(batch)
            except GraphCaptureFailed:  # logged; this and every later step run eagerly
                pass
        return self.model.forward(self.backend.prepare(batch)).cpu()
