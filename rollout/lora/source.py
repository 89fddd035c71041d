"""What a PEFT model serves unmerged: its active LoRA adapter's A and B per targeted linear,
and its base weights as they are (no delta folded in).

Only plain LoRA on nn.Linear layers is served this way, one adapter active at a time. Anything
else raises `Unsupported` with the reason (the engine then merges, as before, unless
EngineConfig(lora="unmerged") asked for unmerged, which turns it into a ValueError):
DoRA and other variants, LoRA biases, several active adapters, an adapter merged into the base
(`merge_adapter()`), fan_in_fan_out layers, and LoRA on embeddings, convolutions or on
parameters (`target_parameters`, e.g. MoE experts). Dropout is not applied: the engine samples
as PEFT's forward does in eval mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..colocation.weights import (
    check_tensor,
    hf_name,
    is_lora_layer,
    is_modules_to_save,
    is_peft,
    unused_copies,
    unwrap,
)


class Unsupported(Exception):
    """This source's adapter cannot be served unmerged; the message says why."""


@dataclass(frozen=True)
class SourceLora:
    """The active adapter of one targeted linear of the source."""

    name: str  # HF name of the linear: model.layers.0.self_attn.q_proj
    a: torch.Tensor  # lora_A [r, in]: the source's parameter itself, not a copy
    b: torch.Tensor  # lora_B [out, r]
    scale: float
    base_shape: torch.Size  # the base linear's weight [out, in]

    @property
    def rank(self) -> int:
        return self.a.shape[0]


def is_peft_lora(model) -> bool:
    return isinstance(model, nn.Module) and is_peft(unwrap(model))


def read_source(model: nn.Module) -> tuple[list[SourceLora], list[tuple[str, nn.Parameter]]]:
    """One walk of the model: the active adapter's layers (none inside `disable_adapter()`),
    each checked from its metadata (check_tensor) and for its shapes, Unsupported for what
    cannot be served; and (HF name, parameter) of the base weights: every weight but the
    adapters, unmerged, and of a `modules_to_save` wrapper the copy in use."""
    model = unwrap(model)
    layers, base, active, seen = [], [], set(), set()
    unused: tuple[str, ...] = ()  # modules_to_save copies the forward skips, as "name."
    for name, module in model.named_modules():
        if unused and f"{name}.".startswith(unused):
            continue
        if is_modules_to_save(module):
            unused += tuple(f"{name}.{c}." for c in unused_copies(module))
        elif hasattr(type(module), "adapter_layer_names"):
            here = _active_here(name, module)
            active.update(here)
            if here:
                layers.append(_layer(hf_name(name), module, here))
        for local, param in module._parameters.items():
            if param is None or id(param) in seen or local.startswith("lora_") \
                    or ".lora_" in f".{name}":
                continue
            seen.add(id(param))  # tied weights once, under their first name
            base.append((hf_name(f"{name}.{local}" if name else local), param))
    if len(active) > 1:
        raise Unsupported(f"{len(active)} adapters are active at once ({sorted(active)}); one "
                          f"is served unmerged")
    return layers, base


def _active_here(name: str, module: nn.Module) -> list[str]:
    """The adapters active in a PEFT tuner layer, in any of its kinds (lora_A,
    lora_embedding_A, ...); Unsupported for a layer no LoRA or merged into its base."""
    if not is_lora_layer(module):
        raise Unsupported(f"{name}: a {type(module).__name__} adapter (only LoRA is served "
                          f"unmerged)")
    if getattr(module, "merged_adapters", None):
        raise Unsupported(f"{name}: adapter {module.merged_adapters} is merged into the base "
                          f"weight (merge_adapter)")
    if module.disable_adapters:
        return []
    return [a for a in module.active_adapters
            if any(a in getattr(module, kind) for kind in module.adapter_layer_names)]


def _layer(name: str, module: nn.Module, adapters: list[str]) -> SourceLora:
    adapter = adapters[0]
    base = module.get_base_layer()
    kind = type(base).__name__
    if (not isinstance(base, nn.Linear) or getattr(base, "weight", None) is None
            or adapter not in module.lora_A):
        raise Unsupported(f"{name}: LoRA on a {kind} (only nn.Linear layers are served "
                          f"unmerged)")
    if adapter in getattr(module, "lora_variant", {}):
        variant = type(module.lora_variant[adapter]).__name__
        raise Unsupported(f"{name}: adapter {adapter!r} is a LoRA variant ({variant}, e.g. "
                          f"DoRA)")
    if getattr(module, "lora_bias", {}).get(adapter):
        raise Unsupported(f"{name}: adapter {adapter!r} has a LoRA bias (lora_bias=True)")
    if getattr(module, "fan_in_fan_out", False):
        raise Unsupported(f"{name}: fan_in_fan_out layers (Conv1D weights)")
    a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
    for part, tensor in (("lora_A", a), ("lora_B", b)):
        check_tensor(f"{name}.{part}.{adapter}.weight", tensor)
    out, inner = base.weight.shape
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(f"LoRA {name!r} adapter {adapter!r}: lora_A {tuple(a.shape)} and "
                         f"lora_B {tuple(b.shape)} do not share a rank")
    if a.shape[1] != inner or b.shape[0] != out:
        raise ValueError(f"LoRA {name!r} adapter {adapter!r}: lora_A {tuple(a.shape)} and "
                         f"lora_B {tuple(b.shape)} do not fit its base weight "
                         f"{tuple(base.weight.shape)} (expected [r, {inner}] and [{out}, r])")
    return SourceLora(name, a, b, float(module.scaling[adapter]), base.weight.shape)
