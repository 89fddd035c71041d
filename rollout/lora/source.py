"""What a PEFT model serves unmerged: its active LoRA adapter's A and B per targeted linear,
and its base weights as they are (no delta folded in).

Plain LoRA on nn.Linear layers and on parameters (`target_parameters`: a linear's 2-D weight,
or a stacked MoE expert parameter [E, out, in]) is served this way, one adapter active at a
time. Anything else raises `Unsupported` with the reason (the engine then merges, as before,
unless EngineConfig(lora="unmerged") asked for unmerged, which turns it into a ValueError):
DoRA and other variants, LoRA biases, several active adapters, an adapter merged into the base
(`merge_adapter()`), fan_in_fan_out layers, expert stacks stored [E, in, out], and LoRA on
embeddings or convolutions. Dropout is not applied: the engine samples as PEFT's forward does
in eval mode.

PEFT's layout for E experts (its ParamWrapper): lora_A [E*r, in] holds expert e's A in rows
e*r .. e*r + r; lora_B [out, r*E] holds its B in columns e, e + E, e + 2E, ... (`expert_a`,
`expert_b` view them as [E, r, in] and [E, out, r]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..colocation.weights import (
    active_adapters,
    check_adapter_kinds,
    check_tensor,
    hf_name,
    is_lora_layer,
    is_modules_to_save,
    is_tuner_layer,
    unused_copies,
    unwrap,
    weight_params,
)


class Unsupported(Exception):
    """This source's adapter cannot be served unmerged; the message says why."""


@dataclass(frozen=True)
class SourceLora:
    """The active adapter of one targeted weight of the source."""

    weight: str  # HF name of the weight: model.layers.0.self_attn.q_proj.weight
    a: torch.Tensor  # lora_A [r, in] (experts: [E*r, in]): the source's parameter, not a copy
    b: torch.Tensor  # lora_B [out, r] (experts: [out, r*E])
    scale: float
    base_shape: torch.Size  # the weight's [out, in] (experts: [E, out, in])
    experts: int = 0  # E for a stacked expert parameter, else 0
    parametrized: bool = False  # adapted as a parameter (PEFT's ParamWrapper)

    @property
    def name(self) -> str:
        return self.weight.removesuffix(".weight")

    @property
    def rank(self) -> int:
        return self.a.shape[0] // max(1, self.experts)


def expert_a(a: torch.Tensor, experts: int) -> torch.Tensor:
    """PEFT's lora_A [E*r, in] of a stacked expert parameter as [E, r, in] (a view); a linear's
    (experts = 0) as it is."""
    return a.view(experts, -1, a.shape[-1]) if experts else a


def expert_b(b: torch.Tensor, experts: int) -> torch.Tensor:
    """PEFT's lora_B [out, r*E] as [E, out, r] (a view); a linear's as it is."""
    return b.view(b.shape[0], -1, experts).permute(2, 0, 1) if experts else b


def is_peft_lora(model) -> bool:
    """A model holding PEFT LoRA layers: from get_peft_model, its tuner model
    (`peft_model.base_model`), or peft.inject_adapter_in_model."""
    return isinstance(model, nn.Module) and any(
        is_tuner_layer(m) and is_lora_layer(m) for m in unwrap(model).modules())


def read_source(model: nn.Module) -> tuple[list[SourceLora], list[tuple[str, nn.Parameter]]]:
    """The active adapter's layers (none inside `disable_adapter()`), each checked from its
    metadata (check_tensor) and for its shapes, Unsupported for what cannot be served
    unmerged (ValueError for what is served in no mode: check_adapter_kinds);
    and (HF name, parameter) of the base weights: every weight but the adapters, unmerged, and
    of a `modules_to_save` wrapper the copy in use (weight_params: replicated layers' shared
    base weights under each layer's name)."""
    model = unwrap(model)
    check_adapter_kinds(model)
    layers, active = [], set()
    unused: tuple[str, ...] = ()  # modules_to_save copies the forward skips, as "name."
    for name, module in model.named_modules():
        if unused and f"{name}.".startswith(unused):
            continue
        if is_modules_to_save(module):
            unused += tuple(f"{name}.{c}." for c in unused_copies(module))
        elif is_tuner_layer(module):
            here = _active_here(name, module)
            active.update(here)
            if here:
                layers.append(_layer(name, module, here))
    if len(active) > 1:
        raise Unsupported(f"{len(active)} adapters are active at once ({sorted(active)}); one "
                          f"is served unmerged")
    return layers, [(hf_name(name), param) for name, param in weight_params(model)]


def _active_here(name: str, module: nn.Module) -> list[str]:
    """The adapters active in a PEFT tuner layer, in any of its kinds (lora_A,
    lora_embedding_A, ...); Unsupported for a layer no LoRA or merged into its base."""
    # AdaLoRA's layers pass for LoRA ones (lora_A, get_delta_weight) but hold their factors as
    # bare parameters, scaled by lora_E and ranknum: not LoRA's B A.
    if not is_lora_layer(module) or not isinstance(module.lora_A, nn.ModuleDict):
        raise Unsupported(f"{name}: a {type(module).__name__} adapter (only LoRA is served "
                          f"unmerged)")
    if getattr(module, "merged_adapters", None):
        raise Unsupported(f"{name}: adapter {module.merged_adapters} is merged into the base "
                          f"weight (merge_adapter)")
    return active_adapters(module)


def _layer(path: str, module: nn.Module, adapters: list[str]) -> SourceLora:
    adapter = adapters[0]
    base = module.get_base_layer()
    kind = type(base).__name__
    wrapped = getattr(module, "parameter_name", None)  # PEFT's ParamWrapper (target_parameters)
    # A wrapper nested in another (one per parameter of the experts) ends in .base_layer.
    weight = hf_name(f"{path}.{wrapped or 'weight'}")
    name = weight.removesuffix(".weight")
    if wrapped is None and (not isinstance(base, nn.Linear)
                            or getattr(base, "weight", None) is None):
        raise Unsupported(f"{name}: LoRA on a {kind} (only nn.Linear layers and targeted "
                          f"parameters are served unmerged)")
    if adapter not in module.lora_A:
        raise Unsupported(f"{name}: adapter {adapter!r} on a {kind} is not a LoRA A/B pair")
    if adapter in getattr(module, "lora_variant", {}):
        variant = type(module.lora_variant[adapter]).__name__
        raise Unsupported(f"{name}: adapter {adapter!r} is a LoRA variant ({variant}, e.g. "
                          f"DoRA)")
    if getattr(module, "lora_bias", {}).get(adapter):
        raise Unsupported(f"{name}: adapter {adapter!r} has a LoRA bias (lora_bias=True)")
    if getattr(module, "fan_in_fan_out", False):
        raise Unsupported(f"{name}: fan_in_fan_out layers (Conv1D weights)")
    a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
    label = f"LoRA {name!r} adapter {adapter!r}"
    for part, tensor in (("lora_A", a), ("lora_B", b)):
        check_tensor(f"{name}.{part}.{adapter}.weight", tensor)
    param = module.get_param() if wrapped else base.weight
    experts = 0
    if param.dim() == 3:
        if not module._did_swap_in_out_features:
            raise Unsupported(f"{weight}: LoRA on experts stored [E, in, out] (is_transposed)")
        experts = param.shape[0]
    out, inner = param.shape[-2:]
    rows = a.shape[0] if a.dim() == 2 else 0
    if a.dim() != 2 or b.dim() != 2 or rows != b.shape[1] or rows % max(1, experts):
        raise ValueError(f"{label}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                         f"share a rank" + (f" over {experts} experts" if experts else ""))
    if a.shape[1] != inner or b.shape[0] != out:
        rank = "r * E" if experts else "r"
        raise ValueError(f"{label}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                         f"fit its base weight {tuple(param.shape)} (expected [{rank}, {inner}] "
                         f"and [{out}, {rank}])")
    return SourceLora(weight, a, b, float(module.scaling[adapter]), param.shape, experts,
                      parametrized=wrapped is not None)
