"""Where update_weights gets its tensors: a trainer's model (wrapped or not) or named tensors.

Names come out in Hugging Face form (`model.layers.0.self_attn.q_proj.weight`): wrapper
prefixes (DDP's `module.`, torch.compile's `_orig_mod.`, PEFT's `base_model.model.` and
`.base_layer.`) are stripped, and PEFT LoRA adapters are folded into the base weights. Plain
LoRA is added out of place (base + delta, one layer at a time), so the trainer's frozen base
weights are never written: an in-place merge + unmerge is not exact in floating point and would
drift them a little on every sync. Other adapter kinds (DoRA, LoRA bias) fall back to PEFT's
merge_adapter / unmerge_adapter for the duration of the read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

_WRAPPER_ATTRS = ("module", "_orig_mod")  # DDP / DeepSpeed engine / FSDP, torch.compile
_NAME_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")


def unwrap(model: nn.Module) -> nn.Module:
    """Peel DDP/DeepSpeed/compile wrappers (what accelerate's unwrap_model does for these)."""
    while any(isinstance(getattr(model, a, None), nn.Module) for a in _WRAPPER_ATTRS):
        model = next(getattr(model, a) for a in _WRAPPER_ATTRS
                     if isinstance(getattr(model, a, None), nn.Module))
    return model


def hf_name(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _NAME_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    # PEFT keeps a trained copy of `modules_to_save` beside the frozen original.
    return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "merge_adapter") and hasattr(model, "unmerge_adapter")


@contextlib.contextmanager
def merged_adapters(model: nn.Module):
    """LoRA deltas folded into the base weights while the weights are read."""
    if not is_peft(model):
        yield
        return
    model.merge_adapter()
    try:
        yield
    finally:
        model.unmerge_adapter()


def lora_layers(model: nn.Module) -> dict[str, nn.Module] | None:
    """Base-weight parameter name -> its LoRA layer, for adding deltas out of place; None when
    some active adapter is not a plain `weight + delta` (a variant such as DoRA, or a bias)."""
    layers = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "get_delta_weight")):
            continue
        for a in _unmerged_adapters(module):
            if a in getattr(module, "lora_variant", {}) or getattr(module, "lora_bias", {}).get(a):
                return None
        layers[f"{name}.base_layer.weight"] = module
    return layers


def _unmerged_adapters(module: nn.Module) -> list[str]:
    if getattr(module, "disable_adapters", False):
        return []
    merged = set(getattr(module, "merged_adapters", []))  # already inside the base weight
    return [a for a in module.active_adapters if a in module.lora_A and a not in merged]


def model_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named parameters of a (possibly wrapped, possibly PEFT) causal LM, adapters merged.

    Must be consumed inside the generator (it may hold a merge open while it yields)."""
    model = unwrap(model)
    layers = lora_layers(model) if is_peft(model) else {}
    merge = merged_adapters(model) if layers is None else contextlib.nullcontext()
    with merge, torch.no_grad():
        for name, param in _weight_params(model):
            tensor = param.detach()
            if hasattr(tensor, "full_tensor"):
                # FSDP2 / tensor-parallel DTensor shard: gather the whole weight (a collective:
                # every rank syncs its own engine at the same point of the step).
                tensor = tensor.full_tensor()
            if layers and name in layers:
                module = layers[name]
                for adapter in _unmerged_adapters(module):
                    tensor = tensor + module.get_delta_weight(adapter).to(tensor.dtype)
            yield hf_name(name), tensor


def _weight_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters that carry the model's weights: not LoRA adapters (folded in) and not
    the frozen originals PEFT keeps beside `modules_to_save`."""
    for name, param in model.named_parameters():
        if "lora_" not in name and ".original_module." not in name:
            yield name, param


def named_shapes_and_tensors(source) -> tuple[list[tuple[str, torch.Size]],
                                               Iterable[tuple[str, torch.Tensor]]]:
    """(HF name, shape) of every tensor `source` gives, known before any is read, and the
    tensors themselves. A model's shapes come from its parameters (reading its weights may
    merge adapters or gather shards, so that happens once, while copying); other sources,
    generators included, are collected as references (no copies)."""
    if isinstance(source, nn.Module):
        shapes = [(hf_name(n), p.shape) for n, p in _weight_params(unwrap(source))]
        return shapes, model_tensors(source)
    named = list(source.items() if isinstance(source, dict) else source)
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weight {name!r}: expected a torch.Tensor, got "
                             f"{type(tensor).__name__}")
    return [(name, tensor.shape) for name, tensor in named], named


def buckets(named: Iterable[tuple[str, torch.Tensor]], device: torch.device,
            dtype: torch.dtype, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors that live off `device` into flat buckets moved with one copy each, so a
    whole model crosses host<->device in a few large transfers instead of one per parameter.
    Tensors already on `device` pass through untouched (the in-place copy does the rest)."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush():
        flat = torch.cat([t.reshape(-1).to(dtype) for _, t in pending])
        if device.type == "cuda":
            flat = flat.pin_memory()
        flat = flat.to(device, non_blocking=True)
        out, offset = [], 0
        for name, t in pending:
            out.append((name, flat[offset:offset + t.numel()].view(t.shape)))
            offset += t.numel()
        return out

    for name, tensor in named:
        if tensor.device == device:
            yield [(name, tensor)]
            continue
        pending.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield flush()
            pending, size = [], 0
    if pending:
        yield flush()


_optimizer_steps = 0  # every optimizer step in this process, counted by a global hook
_hook = None


def _count_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _watch_optimizers() -> None:
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_count_step)


def weights_version(model: nn.Module) -> tuple[int, ...]:
    """Changes whenever a parameter may have been modified, without reading the weights.
    Autograd's per-tensor version counters catch copy_, load_state_dict and foreach
    optimizers. Storage addresses catch `p.data = ...` (vector_to_parameters, Module.to),
    which leaves the counter alone. Fused optimizer kernels (torch's fused AdamW, the HF
    Trainer's default) write without bumping counters, so any optimizer step in the process
    counts too (at worst one needless sync when some other model's optimizer stepped).
    Not seen: in-place writes through `.data` (`p.data.add_(...)`) bypass the counter; after
    those call `engine.update_weights(model)` (or `ColocatedRollout.sync_weights(force=True)`).
    """
    _watch_optimizers()
    params = list(unwrap(model).parameters())
    return (_optimizer_steps, *(p._version for p in params), *(p.data_ptr() for p in params))
