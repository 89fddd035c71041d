"""Speculative decoding: drafters propose k tokens per running sample, the target verifies all
k+1 positions in one forward, and acceptance keeps the output distribution the target's."""

from .config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
