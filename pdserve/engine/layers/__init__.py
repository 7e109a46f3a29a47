"""The model files' building blocks, each a thin holder of weights over a compute backend."""

from pdserve.engine.layers.embedding import Embedding
from pdserve.engine.layers.linear import Linear
from pdserve.engine.layers.moe import MoE
from pdserve.engine.layers.norm import OffsetRMSNorm, RMSNorm
from pdserve.engine.layers.rotary import Rotary

__all__ = ["Embedding", "Linear", "MoE", "OffsetRMSNorm", "RMSNorm", "Rotary"]
