"""Building blocks shared by the model families: a family file composes these."""

from .attention import Attention, AttentionOptions
from .decoder import Decoder
from .embedding import VocabParallelEmbedding, lm_head
from .linear import MergedLinear, RowParallelLinear
from .mlp import GatedMLP
from .moe import SparseMoE
from .norm import RMSNorm
from .rotary import RotaryEmbedding

__all__ = ["Attention", "AttentionOptions", "Decoder", "GatedMLP", "MergedLinear", "RMSNorm",
           "RotaryEmbedding", "RowParallelLinear", "SparseMoE", "VocabParallelEmbedding",
           "lm_head"]
