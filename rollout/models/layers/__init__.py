"""Building blocks shared by the model families: a family file composes these."""

from .attention import Attention, AttentionOptions
from .decoder import Decoder
from .linear import MergedLinear
from .mlp import GatedMLP
from .norm import RMSNorm
from .rotary import RotaryEmbedding

__all__ = ["Attention", "AttentionOptions", "Decoder", "GatedMLP", "MergedLinear", "RMSNorm",
           "RotaryEmbedding"]
