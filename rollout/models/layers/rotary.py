"""Rotary position embedding with a cos/sin table built once for max_model_len.

Inverse frequencies come from transformers' own RoPE initialisers, so every scaling type it
knows (default, linear, llama3, yarn, longrope, ...) matches the reference. Two kinds depend on
the length of each forward, which a table built once cannot follow, so the engine serves them
only as far as the reference uses one set of frequencies for every sequence (context_length):
- `dynamic` NTK: plain RoPE up to max_position_embeddings, rescaled by the length beyond.
- `longrope` (Phi-3): the short factors up to `original_max_position_embeddings`, the long ones
  (for every position) beyond.
Their table is evaluated at max_model_len, which is within that length for the target model
(a draft model may run past its own: docs of loader.check_context).
Partial rotary (`partial_rotary_factor` < 1, e.g. Phi-4-mini) rotates the first dimensions of
each head only, in the families whose reference reads it (Phi-3; the others ignore it with the
default RoPE and fail with a scaled one). Models with RoPE parameters per layer type (Gemma 3:
local and global bases) build one table per type (`layer_type`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from rollout_kernels.cpu import norm_rope

from ...ops.op import Dispatched, always

# Scalings whose frequencies depend on the sequence length: evaluated at max_model_len (within
# context_length for the target model).
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    return params


def context_length(config) -> int | None:
    """The longest sequence the engine serves `config`'s model: max_position_embeddings, as its
    RoPE scaling extends it (vLLM's reading): linear by its factor, YaRN its original length by
    its factor; Llama 3's max_position_embeddings is the extended length already. The
    length-dependent scalings only as far as their frequencies are one set (module docstring).
    With RoPE per layer type, the shortest: every layer sees every position. None where the
    config states no length."""
    limit = context_limit(config)
    return None if limit is None else limit[0]


def context_limit(config) -> tuple[int, str] | None:
    """(context_length, what sets it: for a refusal's message)."""
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int):
        return None
    params = rope_parameters(config)
    scalings = [params] if "rope_type" in params else [
        p for p in params.values() if isinstance(p, dict)]
    return min((_served(positions, p) for p in scalings),
               default=(positions, f"max_position_embeddings={positions}"))


def _served(positions: int, params: dict) -> tuple[int, str]:
    # YaRN's factor may be None: transformers then takes max_position_embeddings as extended
    factor = params.get("factor") or 1.0
    rope_type = params.get("rope_type")
    declared = f"max_position_embeddings={positions}"
    if rope_type in ("linear", "yarn"):
        length = (int(positions * factor) if rope_type == "linear" else max(
            positions, int(params.get("original_max_position_embeddings", positions) * factor)))
        return length, (declared if length == positions
                        else f"{declared}, as its RoPE scaling extends it")
    if rope_type == "dynamic":
        return positions, (f"{declared}; rope_type 'dynamic' rescales its frequencies by the "
                           "length of each longer sequence, which one table cannot follow")
    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings", positions)
        return original, (f"original_max_position_embeddings={original}; rope_type 'longrope' "
                          "switches to its long factors for longer sequences, which one table "
                          "cannot follow")
    return positions, declared


def _partial_rotary_factor(config, params: dict) -> float:
    return params.get("partial_rotary_factor",
                      getattr(config, "partial_rotary_factor", None) or 1.0)


def _inv_freq(config, head_dim: int, max_model_len: int, layer_type: str | None,
              partial_rotary: bool) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        factor = _partial_rotary_factor(config, params) if partial_rotary else 1.0
        dim = int(head_dim * factor)
        # On the CPU explicitly: built under the engine's device context, it would otherwise
        # stay on the GPU through sleep (or hold no values on meta: loader.py).
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
        return 1.0 / (theta ** (exponents / dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported")
    # transformers' scaled initialisers all read the factor; the families that rotate whole
    # heads then fail on the shorter frequencies, so no reference computes such a model.
    factor = _partial_rotary_factor(config, params)
    if factor < 1 and not partial_rotary:
        raise ValueError(
            f"partial_rotary_factor: {factor} is less than 1 with rope_type {rope_type!r}, in "
            f"model_type {config.model_type!r}, whose transformers reference rotates whole "
            "heads (and fails on this config); set partial_rotary_factor to 1 or use the "
            "default rope_type")
    kwargs = {"seq_len": max_model_len} if rope_type in _LENGTH_DEPENDENT else {}
    if layer_type is not None:
        kwargs["layer_type"] = layer_type
    # transformers makes some of its tensors on the default device, whatever `device` says: on
    # the CPU too, not on the meta device the engine builds its modules on (loader.py), where
    # they would hold no values.
    with torch.device("cpu"):
        return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)


class RotaryEmbedding(Dispatched, nn.Module):
    implementations = {"torch": always, "cpu": norm_rope.supported}  # the C gives torch's bits

    def __init__(self, config, head_dim: int, max_model_len: int,
                 layer_type: str | None = None, partial_rotary: bool = False) -> None:
        """partial_rotary: the family's reference honours `partial_rotary_factor` with the
        default RoPE (CausalLM.PARTIAL_ROTARY)."""
        super().__init__()
        self.inv_freq, self.scaling = _inv_freq(config, head_dim, max_model_len, layer_type,
                                                partial_rotary)
        self.layer_type = layer_type
        self.length_dependent = (rope_parameters(config, layer_type).get("rope_type")
                                 in _LENGTH_DEPENDENT)
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.max_model_len = max_model_len
        # Built by CausalLM.build_tables once the model is on its device: the engine constructs
        # its modules on the meta device (loader.py), where the table would hold no values.
        self.register_buffer("cos_table", None, persistent=False)
        self.register_buffer("sin_table", None, persistent=False)

    # --- the table: built on the device, dropped at sleep, rebuilt at wake (models/base.py) ---
    def build_table(self, device: torch.device) -> None:
        """(Re)compute the fp32 cos/sin tables."""
        positions = torch.arange(self.max_model_len, dtype=torch.int64, device=device).float()
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = emb.cos() * self.scaling
        self.sin_table = emb.sin() * self.scaling

    def drop_table(self) -> None:
        self.cos_table = self.sin_table = None

    @property
    def has_table(self) -> bool:
        return self.cos_table is not None

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [T, 1, rotary_dim] for the step's positions (ForwardContext.rotary calls this
        once per step and table)."""
        return (self.cos_table[positions].to(dtype)[:, None, :],
                self.sin_table[positions].to(dtype)[:, None, :])

    def forward_cpu(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor):
        if (q.dtype == k.dtype == cos.dtype == torch.float32 and q.stride(2) == k.stride(2) == 1
                and q.stride(1) == k.stride(1) == q.shape[2] and k.shape[2] == q.shape[2]):
            norm_rope.rotary_(q, k, cos, sin)  # in place: the step's q and k are its own
            return q, k
        return self.forward_torch(q, k, cos, sin)

    def forward_torch(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor):
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def adopt_rounded_frequencies(model: nn.Module, source: nn.Module) -> int:
    """Take the rotary inverse frequencies of a live transformers `source` where its buffer was
    rounded, so the engine's angles are the ones the trainer's forward computes: `source.to(
    torch.bfloat16)` casts transformers' `inv_freq` buffer, and transformers then builds its
    angles from the rounded values (`from_pretrained(dtype=...)` keeps them float32, and so
    does the engine otherwise). A bf16 gap of 0.048 to such a model after 300 positions was
    0.012 with its frequencies (docs/logprobs.md). Length-dependent scalings keep their own.
    Returns how many tables were rebuilt."""
    theirs: dict[str | None, torch.Tensor] = {}
    for module in source.modules():
        if not type(module).__name__.endswith("RotaryEmbedding"):
            continue
        for name, buffer in module.named_buffers(recurse=False):
            if name == "inv_freq":
                theirs.setdefault(None, buffer)
            elif name.endswith("_inv_freq") and not name.endswith("original_inv_freq"):
                theirs.setdefault(name[:-len("_inv_freq")], buffer)  # Gemma 3: per layer type
    adopted = 0
    for rope in model.modules():
        if not isinstance(rope, RotaryEmbedding) or rope.length_dependent:
            continue
        buffer = theirs.get(rope.layer_type)
        if (buffer is None or buffer.dtype == torch.float32
                or buffer.shape != rope.inv_freq.shape):
            continue
        rope.inv_freq = buffer.detach().to("cpu", torch.float32)
        if rope.has_table:
            rope.build_table(rope.cos_table.device)
        adopted += 1
    return adopted


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :d], x[..., d:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
