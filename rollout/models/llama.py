"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) built from a Hugging Face config.

The modules fuse Q/K/V into one projection and gate/up into another, run over the engine's flat
token axis, and take weights under Hugging Face parameter names through `load_weights`, which
copies in place so tensor addresses (and anything captured against them) stay valid.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN

from .rope import RotaryEmbedding


@dataclass(frozen=True)
class Family:
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mlp_bias: bool


def family_of(config) -> Family:
    kind = config.model_type
    bias = bool(getattr(config, "attention_bias", False))
    if kind == "qwen2":
        return Family(qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)
    if kind == "qwen3":
        return Family(qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False)
    if kind == "mistral":
        return Family(qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=False)
    return Family(qkv_bias=bias, o_bias=bias, qk_norm=False,
                  mlp_bias=bool(getattr(config, "mlp_bias", False)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as the reference models do.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config, family: Family, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=family.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=family.o_bias)
        if family.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, ctx) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k, ctx.cos, ctx.sin)
        out = ctx.attend(q, k, v, self.layer, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config, family: Family) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate,
                                      bias=family.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=family.mlp_bias)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, family: Family, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, family, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, family)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, ctx) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config, family: Family) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, family, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# HF checkpoint names that land in a slice of one of our fused parameters:
# (their module name, our module name, which shard).
_FUSED = (("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
          ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, max_model_len: int) -> None:
        super().__init__()
        check_supported(config, max_model_len)
        self.config = config
        family = family_of(config)
        self.model = Decoder(config, family)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        attn = self.model.layers[0].self_attn
        self.rope = RotaryEmbedding(config, attn.head_dim, max_model_len)
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.vocab_size = config.vocab_size

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        """Hidden states [T, hidden] of the flat batch; `ctx` carries positions' cos/sin and
        the attention call (see model_runner.ForwardContext)."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, self.rope, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head_weight.t()).float()

    # --- weights ----------------------------------------------------------------------------
    def check_weights(self, named_shapes: Iterable[tuple[str, torch.Size]]) -> set[str]:
        """What load_weights would write for tensors of these HF names and shapes, reading and
        copying nothing, so that a bad name or shape (ValueError) is refused before any weight
        changes."""
        params = dict(self.named_parameters())
        written: set[str] = set()
        for name, shape in named_shapes:
            dest = self._destination(params, name, shape)
            if dest is not None:
                written.add(dest[1])
        return written

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (fused) parameters in place; returns the names of
        our parameters that were written. An unknown name or a wrong shape raises ValueError
        when reached: check_weights first to refuse before anything is copied."""
        params = dict(self.named_parameters())
        written: set[str] = set()
        for name, tensor in named_tensors:
            dest = self._destination(params, name, tensor.shape)
            if dest is not None:
                dest[0].copy_(tensor)
                written.add(dest[1])
        return written

    def _destination(self, params: dict[str, nn.Parameter], name: str,
                     shape: torch.Size) -> tuple[torch.Tensor, str] | None:
        """The parameter (or fused shard of one) that the HF tensor `name` goes to, and the
        name it counts as written; None for tensors we do not keep."""
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding carries it
        target, shard = self._target(name)
        if target not in params:
            raise ValueError(f"weight {name!r}: no such parameter in this "
                             f"{self.config.model_type} model")
        dst = params[target]
        if shard is not None:
            dst = self._shard(target, dst, shard)
        if dst.shape != shape:
            raise ValueError(f"weight {name!r}: shape {tuple(shape)}, expected "
                             f"{tuple(dst.shape)}")
        return dst, target if shard is None else f"{target}[{shard}]"

    @staticmethod
    def _target(name: str) -> tuple[str, int | None]:
        for theirs, ours, shard in _FUSED:
            piece = f".{theirs}."
            if piece in name:
                return name.replace(piece, f".{ours}."), shard
        return name, None

    def _shard(self, target: str, param: torch.Tensor, shard: int) -> torch.Tensor:
        attn = self.model.layers[0].self_attn
        if ".qkv_proj." in target:
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        return param.narrow(0, start, sizes[shard])

    def expected_weight_names(self) -> set[str]:
        """What a complete load writes (for checking that a checkpoint covered everything)."""
        names = set()
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                names.update(f"{name}[{i}]" for i in range(3))
            elif ".gate_up_proj." in name:
                names.update(f"{name}[{i}]" for i in range(2))
            else:
                names.add(name)
        return names


def check_supported(config, max_model_len: int) -> None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    sliding = "sliding_attention" in layer_types or (
        config.model_type == "mistral" and window is not None and window < max_model_len)
    if sliding:
        raise ValueError(f"sliding_window={window}: sliding-window attention is not supported; "
                         f"use max_model_len <= {window} or a config without it")
