"""The attention block of every family: fused QKV projection, optional per-head q/k RMSNorm,
rotary embedding, the engine's attention call, output projection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...parallel import Slice, current, split_heads
from .linear import MergedLinear, RowParallelLinear, row_sources
from .norm import RMSNorm
from .rotary import RotaryEmbedding


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class AttentionOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: bool = False  # that norm in Gemma's (1 + w) form
    scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    softcap: float | None = None  # cap * tanh(score / cap) on the scores (Gemma 2)


class Attention(nn.Module):
    """Under tensor parallelism (rollout/parallel/shard.py split_heads) a rank holds its query
    heads and the KV heads they read: `num_heads` and `num_kv_heads` are this rank's, and so is
    the KV pool it writes. QKV is column-parallel, o_proj row-parallel (one all-reduce)."""

    def __init__(self, config, layer: int, options: AttentionOptions) -> None:
        super().__init__()
        tp = current()
        heads = split_heads(config.num_attention_heads, config.num_key_value_heads, tp)
        self.layer = layer
        self.num_heads, self.num_kv_heads = heads.q_heads, heads.kv_heads
        self.head_dim = d = head_dim_of(config)
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.scale = options.scale if options.scale is not None else d ** -0.5
        self.softcap = options.softcap
        q_full, kv_full = config.num_attention_heads * d, config.num_key_value_heads * d
        q_rows = row_sources(heads.q_start * d, self.q_size, q_full, tp)
        kv_rows = row_sources(heads.kv_start * d, self.kv_size, kv_full, tp)
        self.qkv_proj = MergedLinear(config.hidden_size, (self.q_size, self.kv_size, self.kv_size),
                                     bias=options.qkv_bias,
                                     sources=None if q_rows is None else (q_rows, kv_rows, kv_rows))
        o_cols = None if q_rows is None else Slice(1, q_rows.start, q_rows.length, q_full)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, options.o_bias, tp,
                                        o_cols)
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, options.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, options.norm_offset)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, ctx) -> torch.Tensor:
        q, k, v = self.qkv_proj.forward_split(x)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k, *ctx.rotary(rope, q.dtype))
        out = ctx.attend(q, k, v, self.layer, self.scale, self.softcap)
        return self.o_proj(out.reshape(-1, self.q_size))
