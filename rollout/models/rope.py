"""Rotary position embedding with a cos/sin table built once for max_model_len.

Inverse frequencies come from transformers' own RoPE initialisers, so every scaling type it
knows (default, linear, llama3, yarn, ...) matches the reference. `dynamic` NTK scaling is
evaluated once for max_model_len rather than per batch: positions within the original context
are unaffected only when max_model_len does not exceed it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _inv_freq(config, head_dim: int, max_model_len: int) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        # On the CPU explicitly: built under the engine's device context, it would otherwise
        # stay on the GPU through sleep.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
        inv = 1.0 / (theta ** (exponents / head_dim))
        return inv, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported")
    kwargs = {"seq_len": max_model_len} if rope_type == "dynamic" else {}
    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_model_len: int) -> None:
        super().__init__()
        self.inv_freq, self.scaling = _inv_freq(config, head_dim, max_model_len)
        self.max_model_len = max_model_len
        self.register_buffer("cos_table", None, persistent=False)
        self.register_buffer("sin_table", None, persistent=False)
        self.build(torch.get_default_device())

    def build(self, device: torch.device) -> None:
        """(Re)compute the fp32 cos/sin tables; sleep drops them, since they are cheap."""
        positions = torch.arange(self.max_model_len, dtype=torch.int64, device=device).float()
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = emb.cos() * self.scaling
        self.sin_table = emb.sin() * self.scaling

    def release(self) -> None:
        self.cos_table = self.sin_table = None

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [T, 1, D] for the step's positions, computed once per step."""
        return (self.cos_table[positions].to(dtype)[:, None, :],
                self.sin_table[positions].to(dtype)[:, None, :])

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
