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

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..colocation.weights import (
    check_tensor,
    hf_name,
    is_lora_layer,
    is_modules_to_save,
    is_peft,
    unwrap,
    weight_params,
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


def read_adapters(model: nn.Module) -> list[SourceLora]:
    """The active adapter's layers (none inside `disable_adapter()`), each checked from its
    metadata (check_tensor) and for its shapes; Unsupported for what cannot be served."""
    model = unwrap(model)
    layers, active = [], set()
    for name, module in model.named_modules():
        if not hasattr(type(module), "adapter_layer_names") or is_modules_to_save(module):
            continue  # modules_to_save copies are weights like any other (base_weights)
        if not is_lora_layer(module):
            raise Unsupported(f"{name}: a {type(module).__name__} adapter (only LoRA is served "
                              f"unmerged)")
        if getattr(module, "merged_adapters", None):
            raise Unsupported(f"{name}: adapter {module.merged_adapters} is merged into the "
                              f"base weight (merge_adapter)")
        if module.disable_adapters:
            continue
        # Active here in any of the layer's kinds (lora_A, lora_embedding_A, ...).
        here = [a for a in module.active_adapters
                if any(a in getattr(module, kind) for kind in module.adapter_layer_names)]
        active.update(here)
        if here:
            layers.append(_layer(hf_name(name), module, here))
    if len(active) > 1:
        raise Unsupported(f"{len(active)} adapters are active at once ({sorted(active)}); one "
                          f"is served unmerged")
    return layers


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


def base_weights(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(HF name, parameter) of the weights the engine's base holds: every weight but the
    adapters, unmerged, and of a `modules_to_save` wrapper the copy in use."""
    for name, param in weight_params(unwrap(model)):
        yield hf_name(name), param
