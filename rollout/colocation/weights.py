"""Where update_weights gets its tensors: a trainer's model (wrapped or not) or named tensors.

Names come out in Hugging Face form (`model.layers.0.self_attn.q_proj.weight`): wrappers
(DDP, torch.compile, PEFT's PeftModel and its tuner model) are peeled, prefixes (`module.`,
`_orig_mod.`, `base_model.model.`, `.base_layer.`) stripped, and PEFT LoRA adapters are folded
into the base weights. Adapters are found layer by layer, wherever they were put: by
get_peft_model, or by peft.inject_adapter_in_model into a plain transformers model. LoRA on
linears and embeddings, its variants (DoRA, ...) and LoRA biases are added out of place (base +
delta, one layer at a time), so the trainer's frozen base weights are never written: an
in-place merge + unmerge is not exact in floating point and would drift them a little on every
sync. LoRA on a parameter (the MoE experts' stacks), and a layer with several adapters in use of
which one is a variant, fall back to PEFT's per-layer merge / unmerge for the duration of the
read (lora_layers). What is read follows PEFT's current selection: the active adapter(s), none
inside `disable_adapter()`, and of a `modules_to_save` wrapper the copy its forward uses. Other
PEFT adapters (IA3, LoHa, trainable_token_indices, ...) and LoRA ones that no weight holds
(aLoRA, Arrow, a non-finite scale) are refused by name (check_adapter_kinds), never dropped.

Every tensor is checked from its metadata before any is read or copied (`check_tensor`), so a
bad source raises ValueError and leaves the engine's weights as they were.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import sys
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from itertools import groupby

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef  # imported by torch itself

from .checksum import bit_sum

_WRAPPER_ATTRS = ("module", "_orig_mod")  # DDP / DeepSpeed engine / FSDP, torch.compile
_NAME_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")
# The copies a PEFT `modules_to_save` wrapper keeps of its module (ModuleDict keys hold no dots).
_SAVED_COPY = re.compile(r"\.(original_module|modules_to_save\.[^.]+)\.")


def unwrap(model: nn.Module) -> nn.Module:
    """Peel DDP/DeepSpeed/compile wrappers (what accelerate's unwrap_model does for these) and
    PEFT's: a PeftModel and its tuner model (LoraModel, `peft_model.base_model`) hold the
    transformers model, whose layers carry the adapters (found per layer, as for
    peft.inject_adapter_in_model). A PeftModel of prompt learning (no tuner) is left as it
    is: its names are not the model's, so reading it is a ValueError, not its base served."""
    while True:
        inner = next((getattr(model, a) for a in _WRAPPER_ATTRS
                      if isinstance(getattr(model, a, None), nn.Module)), None)
        if inner is None:
            inner = _peft_inner(model)
        if inner is None:
            return model
        model = inner


def _peft_inner(wrapper: nn.Module) -> nn.Module | None:
    peft = sys.modules.get("peft")  # a PEFT wrapper exists only where peft was imported
    if peft is None:
        return None
    tuner = peft.tuners.tuners_utils.BaseTuner
    if isinstance(wrapper, peft.PeftModel) and isinstance(wrapper.base_model, tuner):
        return wrapper.base_model
    return wrapper.model if isinstance(wrapper, tuner) else None


@functools.lru_cache(maxsize=65536)  # names recur at every sync; a pure function of them
def hf_name(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _NAME_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    # PEFT keeps a trained copy of `modules_to_save` per adapter beside the frozen original;
    # weight_params passes on only the one in use.
    while ".base_layer." in name:  # nested wrappers (PEFT's ParamWrapper per MoE parameter)
        name = name.replace(".base_layer.", ".")
    return _SAVED_COPY.sub(".", name)


def check_tied_embeddings(source, ties: bool, name: str = "model") -> None:
    """A model source must tie its LM head to its embedding as the engine's model does
    (`ties`): the engine serves its embedding as a tied head and would drop an untied one's
    weight, and an untied engine gets no head from a tied model. A PEFT model whose config ties
    them but adapts one alone cannot be served either: `modules_to_save` of `lm_head` or
    `embed_tokens` trains a copy of one, and LoRA on one adds its delta to that one only while
    the other multiplies by the plain tied weight. Nor can a model whose config ties them while
    its head holds other values than its embedding (what transformers loads from a checkpoint
    holding both, config unchanged). ValueError naming `name`, before anything is read. (The
    config says, not the tensors: a sharder may hold a tied pair as two tensors of the same
    values.)"""
    if not isinstance(source, nn.Module):
        return
    model = unwrap(source)
    config = getattr(model, "config", None)
    source_ties = getattr(config, "tie_word_embeddings", None)
    if isinstance(source_ties, bool) and source_ties != ties:
        raise ValueError(f"{name}: its config has tie_word_embeddings={source_ties}, the "
                         f"engine's model {ties}: it is not the architecture the engine "
                         f"serves (build the engine from this model or its config)")
    heads = _heads(model)
    if not ties or heads is None:
        return
    weights = [getattr(h, "weight", None) for h in heads]
    if (any(is_modules_to_save(h) for h in heads) and all(w is not None for w in weights)
            and weights[0] is not weights[1]):
        raise ValueError(f"{name}: its config ties the LM head to the input embedding "
                         "(tie_word_embeddings), but the two are different tensors (PEFT's "
                         "modules_to_save of lm_head or embed_tokens trains a copy of one); "
                         "the engine would serve the embedding as the head. Untie them in the "
                         "config the engine is built from, or adapt neither")
    # (an adapter merged into the tied weight changes both, as in PEFT's forward: served)
    adapted = [h for h in heads if is_lora_layer(h) and unmerged_adapters(h)]
    if adapted:
        which = " and ".join(type(h.get_base_layer()).__name__ for h in adapted)
        raise ValueError(f"{name}: its config ties the LM head to the input embedding "
                         f"(tie_word_embeddings), but LoRA adapts its {which} (PEFT adds the "
                         f"delta to that one alone; the other multiplies by the plain tied "
                         f"weight); the engine would serve the embedding as the head. Untie "
                         f"them in the config the engine is built from, or adapt neither")
    _check_equal_pair(*weights, name)


def _check_equal_pair(embedding, head, name: str) -> None:
    """The pair of a tied config held as two plain tensors must hold the same values (as .bin
    checkpoints and some sharders store a tied pair); a sharded DTensor or a flat FSDP
    parameter is the sharder's, which ties by the config."""
    if head is embedding or not all(type(getattr(w, "data", None)) is torch.Tensor
                                    for w in (head, embedding)):
        return
    if (head.shape == embedding.shape and head.device == embedding.device
            and not torch.equal(head, embedding)):
        raise ValueError(f"{name}: its config has tie_word_embeddings=True, but its lm_head is "
                         "another tensor than its embedding, of other values (transformers "
                         "leaves a checkpoint's pair untied when it holds both), and the "
                         "engine would serve the embedding as the head; set "
                         "config.tie_word_embeddings = False to serve its own lm_head")


def _heads(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(input embedding, LM head) of a causal LM (PEFT's wrappers of them, if adapted)."""
    try:
        return model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def _tied_weight(model: nn.Module) -> nn.Parameter | None:
    """The tensor an LM head tied to the input embedding shares with it; None if untied."""
    weights = [getattr(h, "weight", None) for h in _heads(model) or (None, None)]
    return weights[0] if weights[0] is not None and weights[0] is weights[1] else None


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "merge_adapter") and hasattr(model, "unmerge_adapter")


def is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "get_delta_weight")


def is_tuner_layer(module: nn.Module) -> bool:
    """A PEFT adapter layer (LoRA and other tuners, modules_to_save and trainable-token
    wrappers): told apart by a class attribute, which looking up on the class skips
    nn.Module.__getattr__ (a missing attribute costs that on every module)."""
    return hasattr(type(module), "adapter_layer_names")


# LoRA variants no weight holds: aLoRA adds its delta only to the tokens after its invocation
# sequence, Arrow's router to each token the task adapters it picks (PEFT's merge raises for
# both); by class name, with the LoraConfig field that asks for each.
_UNMERGEABLE = {"ALoraLinearVariant": "alora_invocation_tokens",
                "ArrowLinearVariant": "arrow_config"}


def check_adapter_kinds(model: nn.Module) -> None:
    """ValueError naming the first PEFT adapter layer that is served in no lora mode: only LoRA
    layers (folded in, or served unmerged) and modules_to_save copies are; anything else
    (trainable_token_indices' TrainableTokensWrapper, IA3, LoHa, ...) would otherwise be
    dropped or named as an unknown weight. Of a LoRA layer, an active adapter that is a
    variant acting per token (aLoRA, Arrow), whose scale is not finite (lora_alpha / r, or
    set_scale: every logit would be NaN), or with a LoRA bias on a layer without a bias
    (_check_lora_bias) is refused too."""
    for name, module in model.named_modules():
        if not is_tuner_layer(module):
            continue
        if not (is_lora_layer(module) or is_modules_to_save(module)):
            kind = f"{type(module).__module__}.{type(module).__qualname__}"  # ia3's Linear
            raise ValueError(f"{hf_name(name)}: a {kind} adapter is served in no lora mode: "
                             f"the engine serves PEFT's LoRA adapters and modules_to_save "
                             f"copies only")
        if is_modules_to_save(module):
            continue
        for adapter in active_adapters(module):
            variant = getattr(module, "lora_variant", {}).get(adapter)
            field = _UNMERGEABLE.get(type(variant).__name__)
            if field:
                raise ValueError(f"{hf_name(name)}: adapter {adapter!r} ({field}) acts on some "
                                 f"tokens only, which no weight holds: it is served in no lora "
                                 f"mode")
            scale = getattr(module, "scaling", {}).get(adapter)
            if scale is not None and not math.isfinite(scale):
                raise ValueError(f"{hf_name(name)}: scaling[{adapter!r}] is {scale} (lora_alpha "
                                 f"/ r, or set_scale); it must be finite")
            _check_lora_bias(name, module, adapter)


def _check_lora_bias(name: str, module: nn.Module, adapter: str) -> None:
    """ValueError for an adapter with a LoRA bias on a layer whose base layer has no bias
    (PEFT warns that it cannot be merged): PEFT adds lora_B's bias to that layer's output,
    and the engine's projection has no bias to fold it into, merged (lora_layers would add it
    to a base bias that does not exist, dropping it) or unmerged."""
    if (getattr(module, "lora_bias", {}).get(adapter)
            and getattr(module.get_base_layer(), "bias", None) is None):
        raise ValueError(f"{hf_name(name)}: adapter {adapter!r} has a LoRA bias "
                         f"(lora_bias=True) on a layer with no bias: PEFT adds it to the "
                         f"layer's output, the engine has no bias there to add it to")


def is_modules_to_save(module: nn.Module) -> bool:
    """A PEFT `modules_to_save` wrapper."""
    return (isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict)
            and hasattr(module, "original_module"))


@contextlib.contextmanager
def merged_adapters(layers: list[nn.Module]):
    """PEFT's merge of each LoRA layer's adapters in use into its base weight (what its
    merge_adapter does, layer by layer) while the weights are read; the layers merged so far
    unmerged on the way out, also when a merge fails."""
    merged = []
    try:
        for layer in layers:
            adapters = unmerged_adapters(layer)  # what its forward adds (none: disabled)
            if adapters:
                # Listed first: PEFT counts each adapter as merged as it goes, so a failure on
                # the second leaves the first in the weight; unmerge() undoes what it counted.
                merged.append(layer)
                layer.merge(adapter_names=adapters)
        yield
    finally:
        for layer in merged:
            if layer.merged:  # (none, where its first adapter's merge failed)
                layer.unmerge()


Adding = Callable[[torch.Tensor], torch.Tensor]  # a base tensor -> it with a layer's deltas


def lora_layers(model: nn.Module) -> tuple[dict[str, Adding], list[nn.Module]]:
    """(parameter name -> what adds its LoRA layer's deltas to it out of place: to the base
    weight, and to the base bias where an adapter has a LoRA bias), and the LoRA layers whose
    adapters PEFT's merge folds in place while the weights are read: LoRA on a parameter
    (PEFT's ParamWrapper: the MoE experts' stacked 3-D weights, whose delta has the
    parameter's layout), and a layer with several adapters in use, one of them a variant
    (DoRA's merge_safe reads the layer's base weight, not the sum so far).
    ValueError for adapters served in no mode, and for an in-place merge into a weight that
    several adapted layers share (PEFT's layer_replication: each layer's delta would land in
    every one)."""
    check_adapter_kinds(model)
    adding: dict[str, Adding] = {}
    in_place, adapted = [], {}
    for name, m in model.named_modules():
        if not is_lora_layer(m):
            continue
        adapters = unmerged_adapters(m)
        variants = getattr(m, "lora_variant", {})
        merged = hasattr(m, "parameter_name") or (
            len(adapters) > 1 and any(a in variants for a in adapters))
        weight = _base_weight(m)
        other = adapted.setdefault(id(weight), (name, merged))
        if weight is not None and other[0] != name and (merged or other[1]):
            raise ValueError(f"{hf_name(name)}: its base weight is {hf_name(other[0])}'s too "
                             f"(PEFT's layer_replication), and an adapter of one is merged in "
                             f"place (LoRA on a parameter, or several adapters in use with a "
                             f"variant): each layer's delta would land in both; one adapter "
                             f"in use per layer is added out of place")
        if merged:
            in_place.append(m)
            continue
        adding[f"{name}.base_layer.weight"] = functools.partial(_with_deltas, m)
        if any(getattr(m, "lora_bias", {}).get(a) for a in adapters):
            adding[f"{name}.base_layer.bias"] = functools.partial(_with_bias_deltas, m)
    return adding, in_place


def _base_weight(layer: nn.Module) -> torch.Tensor | None:
    """The weight a LoRA layer's deltas go to: the parameter of a LoRA on a parameter, else its
    base layer's weight."""
    if hasattr(layer, "parameter_name"):
        return layer.get_param()
    return getattr(layer.get_base_layer(), "weight", None)


def _merged_in_place(layers: list[nn.Module]) -> set[int]:
    """Ids of the tensors PEFT's merge of `layers` writes: each one's base weight, and a
    linear's base bias (LoRA biases)."""
    return {id(t) for layer in layers
            for t in (_base_weight(layer), getattr(layer.get_base_layer(), "bias", None))
            if t is not None}


def _with_deltas(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The base weight with the layer's adapters in use added; a variant's by its merge_safe
    (DoRA: the sum scaled by its magnitude over its norm), which keeps what an unmerge would
    need (DoRA's norm) in the layer's caches: left as they were, nothing being merged."""
    for adapter in unmerged_adapters(layer):
        variant = getattr(layer, "lora_variant", {}).get(adapter)
        if variant is None:
            weight = weight + whole(layer.get_delta_weight(adapter)).to(weight.dtype)
            continue
        caches = dict(layer._caches)
        try:
            weight = variant.merge_safe(layer, adapter, weight)
        finally:
            layer._caches.clear()
            layer._caches.update(caches)
    return weight


def _with_bias_deltas(layer: nn.Module, bias: torch.Tensor) -> torch.Tensor:
    """The base bias with the LoRA biases in use added (lora_B's, scaled, as its forward
    adds it)."""
    for adapter in unmerged_adapters(layer):
        if layer.lora_bias.get(adapter):
            delta = whole(layer.lora_B[adapter].bias) * layer.scaling[adapter]
            bias = bias + delta.to(bias.dtype)
    return bias


def active_adapters(module: nn.Module) -> list[str]:
    """The adapters a PEFT layer's forward uses: the active ones this layer holds, in any of
    its kinds (lora_A on a linear, lora_embedding_A on an embedding, ...); none inside
    `disable_adapter()`."""
    if module.disable_adapters:
        return []
    return [a for a in module.active_adapters
            if any(a in getattr(module, kind) for kind in module.adapter_layer_names)]


def unmerged_adapters(module: nn.Module) -> list[str]:
    merged = set(module.merged_adapters)  # already inside the base weight
    return [a for a in active_adapters(module) if a not in merged]


def model_tensors(model: nn.Module, gather: bool = True
                  ) -> Generator[tuple[str, torch.Tensor], None, None]:
    """HF-named parameters of a (possibly wrapped, possibly PEFT) causal LM, adapters merged
    (`gather`: see _read). Its adapters are checked now (lora_layers' ValueError), before a
    tensor is read.

    Consume it to the end or close() it: it may hold PEFT's merge open while it yields."""
    model = unwrap(model)
    adding, in_place = lora_layers(model)
    return _model_tensors(model, adding, in_place, gather)


def _model_tensors(model: nn.Module, adding: dict[str, Adding], in_place: list[nn.Module],
                   gather: bool):
    # What the in-place merge writes is yielded as a copy: a consumer may hold a tensor past
    # the next one (update_weights' host buckets, DTensor re-sharding) and read it only after
    # the generator's end has unmerged it.
    merged = _merged_in_place(in_place)
    with merged_adapters(in_place):
        for name, param in weight_params(model):
            tensor = _read(param, adding.get(name), gather)
            yield hf_name(name), tensor.clone() if id(param) in merged else tensor


@torch.no_grad()  # per tensor: a no_grad held across the yields would disable grad in the caller
def _read(tensor: torch.Tensor, add: Adding | None = None, gather: bool = True) -> torch.Tensor:
    """A weight, whole, with its LoRA layer's deltas added (`add`); with `gather` False a
    DTensor stays one (update_weights re-shards it to its ranks' parts,
    rollout/parallel/reshard.py) unless LoRA deltas are added to it."""
    tensor = tensor.detach()
    if gather or add is not None:
        tensor = whole(tensor)
    return tensor if add is None else add(tensor)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor, gathered whole where it is an FSDP2 / tensor-parallel DTensor shard (a
    collective: every rank syncs its own engine at the same point of the step). FSDP2 shards
    a PEFT model's adapters as it shards its base, so their deltas are DTensors too."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def weight_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters that carry the model's weights: not LoRA adapters (folded in), and of
    each `modules_to_save` wrapper only the copy its forward uses now. A tensor shared under
    several names is listed under each (PEFT's layer_replication shares a base weight between
    layers that each add their own delta), but for an LM head tied to the embedding: listed
    once, under the embedding's name, as a checkpoint holds it."""
    unused = tuple(f"{name}.{copy}." for name, module in model.named_modules()
                   if is_modules_to_save(module) for copy in unused_copies(module))
    # a tuner layer's own bookkeeping parameters (AdaLoRA's ranknum) are no weights either
    unused += tuple(f"{name}.{other}." for name, module in model.named_modules()
                    if is_tuner_layer(module)
                    for other in getattr(module, "other_param_names", ()))
    adapters = {name for name, *_ in _adapter_params(model)}
    tied, listed = _tied_weight(model), False
    for name, param in model.named_parameters(remove_duplicate=False):
        if param is tied:
            if listed:
                continue
            listed = True
        if name not in adapters and not name.startswith(unused):
            yield name, param


def unused_copies(wrapper: nn.Module) -> list[str]:
    """What PEFT's ModulesToSaveWrapper.forward skips: it runs the active adapter's copy, or the
    frozen original while adapters are disabled or an active adapter has no copy here."""
    active = wrapper.active_adapters
    own = (bool(active) and not wrapper.disable_adapters
           and all(a in wrapper.modules_to_save for a in active))
    used = f"modules_to_save.{active[0]}" if own else "original_module"
    copies = ["original_module", *(f"modules_to_save.{a}" for a in wrapper.modules_to_save)]
    return [c for c in copies if c != used]


def _adapter_params(model: nn.Module
                    ) -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
    """(name, its LoRA layer, adapter, parameter) of each LoRA layer's own parameters: PEFT
    names them all lora_* (lora_A.<adapter>.weight, lora_magnitude_vector.<adapter>.weight,
    ...), as an adapter's name may be too (lm_head.modules_to_save.lora_ft.weight is a weight,
    not an adapter's)."""
    for name, module in model.named_modules(remove_duplicate=False):
        if not is_lora_layer(module):
            continue
        for local, param in module.named_parameters(remove_duplicate=False):
            kind, _, rest = local.partition(".")
            if kind.startswith("lora_"):
                yield f"{name}.{local}", module, rest.split(".")[0], param


def _read_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Every parameter that reading the weights touches: the weights and the LoRA adapters
    folded into them."""
    yield from weight_params(model)
    for name, layer, adapter, param in _adapter_params(model):
        if adapter in unmerged_adapters(layer):
            yield name, param


def check_tensor(name: str, tensor) -> None:
    """Refuse (ValueError naming the weight) what cannot be copied in, or only by a silent
    lossy cast, from metadata alone: nothing is read, merged or gathered. Any floating dtype
    is taken and cast to the engine's (float64 -> fp32 rounds no more than fp32 -> bf16 does);
    integer, bool and complex ones are refused (a cast would truncate, or drop the imaginary
    part), and so are sparse (or other non-strided) layouts, whose copy into the dense weights
    fails only once the tensors before them are written. A DTensor is judged the same way, by
    its dtype, layout and its local shard's device; its shape (checked by the model's
    check_weights) is the global one."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"weight {name!r}: expected a torch.Tensor, got "
                         f"{type(tensor).__name__}")
    if tensor.is_meta:
        raise ValueError(f"weight {name!r}: a meta tensor (a shape without data); load or "
                         f"materialise the weights first")
    if tensor.layout != torch.strided:
        raise ValueError(f"weight {name!r}: layout {tensor.layout} is not dense (torch.strided);"
                         f" weights must be dense tensors (.to_dense() first)")
    if not tensor.is_floating_point():
        raise ValueError(f"weight {name!r}: dtype {tensor.dtype} is not floating point; "
                         f"weights must be a floating dtype (cast to the engine's)")


def named_shapes_and_tensors(source) -> tuple[list[tuple[str, torch.Size]],
                                              Generator[tuple[str, torch.Tensor], None, None]]:
    """(HF name, shape) of every tensor `source` gives, each passed through check_tensor
    before any is read, and a generator of the tensors themselves (close() it when copying
    stops early: reading a model may hold PEFT's merge open). A model is checked from its
    parameters (reading its weights may merge adapters or gather shards, so that happens once,
    while copying); other sources, generators included, are collected as references (no
    copies). DTensor shards are left as they are: the engine's copy reshards them."""
    if isinstance(source, nn.Module):
        model = unwrap(source)
        tensors = model_tensors(model, gather=False)  # its adapters checked first
        for name, param in _read_params(model):
            check_tensor(hf_name(name), param)
        return [(hf_name(n), p.shape) for n, p in weight_params(model)], tensors
    named = _pairs(source)
    for name, tensor in named:
        check_tensor(name, tensor)
    return ([(name, tensor.shape) for name, tensor in named],
            ((name, _read(tensor, gather=False)) for name, tensor in named))


def _pairs(source) -> list[tuple[str, torch.Tensor]]:
    """A source that is not a model as (name, tensor) pairs: a dict or an iterable of pairs.
    Anything else (None, a string, loose tensors) is a ValueError saying what was given."""
    kinds = "an nn.Module, a dict of name -> tensor, or an iterable of (name, tensor) pairs"
    if isinstance(source, (str, bytes)) or source is None:
        raise ValueError(f"update_weights: source must be {kinds}, got {type(source).__name__}")
    if isinstance(source, dict):
        items = list(source.items())
    else:
        try:
            items = list(source)
        except TypeError:
            raise ValueError(f"update_weights: source must be {kinds}, got "
                             f"{type(source).__name__}") from None
    for i, item in enumerate(items):
        if (not isinstance(item, (tuple, list)) or len(item) != 2
                or not isinstance(item[0], str)):
            raise ValueError(f"update_weights: source item {i} must be a (name, tensor) pair "
                             f"with a str name, got {type(item).__name__}")
    return [(name, tensor) for name, tensor in items]


def buckets(named: Iterable[tuple[str, torch.Tensor]], device: torch.device,
            dtype: torch.dtype, bucket_bytes: int, separate_host: bool = False
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors that live off `device` into flat buckets moved with one copy each, so a
    whole model crosses host<->device in a few large transfers instead of one per parameter.
    Tensors already on `device` pass through untouched (the in-place copy does the rest).
    `separate_host`: the device's memory is not the host's (a GPU, or the CPU seam of
    colocation/parking.py), so host tensors are off the device even when `device` is the CPU."""
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
        if tensor.device == device and not (separate_host and tensor.device.type == "cpu"):
            yield [(name, tensor)]
            continue
        pending.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield flush()
            pending, size = [], 0
    if pending:
        yield flush()


# Steps of each optimizer given to watch_optimizer, counted apart: one model's steps must not
# move the version of another model in the process (its engine would sync for nothing). Weakly
# keyed: watching keeps no optimizer alive.
_steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
# The models each was watched for (unwrapped): its steps count for them whatever its param
# groups hold, as an optimizer of fp32 master copies (DeepSpeed ZeRO-1/2, apex) holds none of
# the model's parameters and writes them back through `.data`, which no counter sees.
_bound: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.WeakSet] = \
    weakref.WeakKeyDictionary()


def _count_step(optimizer, args, kwargs) -> None:
    _steps[optimizer] += 1


def watch_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> None:
    """Count `optimizer`'s steps in the weights_version of `model` (when given) and of the
    models whose parameters it holds: fused optimizer kernels (torch's fused AdamW, the HF
    Trainer's default on CUDA) write the parameters without bumping autograd's version
    counters, so without this a sync after their step is not seen to be needed. Name the model
    where the optimizer steps copies of its weights (fp32 master weights). The hook is the
    optimizer's own (not a process-wide one); watching twice is once. Wrappers (accelerate's
    AcceleratedOptimizer, DeepSpeed's) are looked through to the optimizer that steps."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got "
                         f"{type(optimizer).__name__}")
    if model is not None and not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer not in _steps:
        optimizer.register_step_post_hook(_count_step)
        _steps[optimizer] = 0
    if model is not None:
        _bound.setdefault(optimizer, weakref.WeakSet()).add(unwrap(model))


def weights_version(model: nn.Module) -> tuple:
    """Changes whenever the weights a read gives may have changed, without reading them.
    Autograd's per-tensor version counters catch copy_, load_state_dict and foreach
    optimizers. The storages catch `p.data = ...` (vector_to_parameters, Module.to), which
    leaves the counter alone: by a weak reference to each, not its address, because two
    swaps between syncs can land the second tensor's data at the first one's freed address
    (the allocator reuses it), while a storage's own record outlives its data as long as a
    weak reference to it does, so no other storage can be told for it by a version held.
    Fused optimizer kernels (torch's fused AdamW, the HF Trainer's default on CUDA) write
    without bumping counters: the steps of the optimizers given to `watch_optimizer` that
    hold some of the model's parameters count too (`_owned_steps`); another model's leave this
    version alone. An optimizer of fp32 master copies holds none: what writes them back into
    the model must be seen (copy_ is, `.data` below is not).
    Not seen: in-place writes through `.data` (`p.data.add_(...)`) bypass the counter; after
    those call `engine.update_weights(model, full=True)` (or
    `ColocatedRollout.sync_weights(force=True)`): `full` also copies a PEFT model's frozen base,
    which a sync otherwise skips while its counters stand still.
    PEFT's `set_adapter`, `disable_adapter()` and a LoRA layer's scaling (`set_scale`,
    `scale_layer`, `rescale_adapter_scale`) change what a read folds in without touching a
    parameter: each adapter layer's selection and scales are part of the version too.
    Inference tensors (made under torch.inference_mode) keep no counter; their addresses
    and the optimizer steps still count. DTensor shards (FSDP2) count by their bits too.
    """
    model = unwrap(model)
    params = list(model.parameters())
    return (_owned_steps(model, params),
            *(-1 if p.is_inference() else p._version for p in params), *_shard_bits(params),
            *(StorageWeakRef(p.untyped_storage()) for p in params),
            *(p.data_ptr() for p in params), _adapter_selection(model))


@torch.no_grad()
def _shard_bits(params: list[nn.Parameter]) -> list[int]:
    """The bit sum of each DTensor parameter's local shard (checksum.bit_sum: one read of
    it, on its device): a foreach optimizer step on DTensors (FSDP2's, torch's default on
    CUDA) writes the shards and moves no version counter, the DTensor's or its shard's. A
    shard on the meta device holds no data to sum (update_weights refuses it)."""
    sums = [bit_sum(t).to(torch.int64) for t in (p.to_local() for p in params
                                                  if hasattr(p, "full_tensor")) if not t.is_meta]
    # One host read per device, not one per parameter (each would wait for the device).
    return [v for _, run in groupby(sums, key=lambda t: t.device)
            for v in torch.stack(list(run)).tolist()]


def _owned_steps(model: nn.Module, params: list[nn.Parameter]) -> tuple:
    """(optimizer, steps) of each watched optimizer that has stepped and was watched for
    `model` or holds some of its `params`, by identity (wrappers and PEFT hold the very
    parameters of the model they wrap), looked up at each call: param groups added or dropped
    since the watch count as they are now (at worst one needless sync when they change). One yet to step has changed nothing:
    left out, watching it moves no version. The optimizer by a weak reference, as the
    storages: a version held keeps none alive, and one gone is told from any made later at its
    address."""
    held = {id(p) for p in params}
    return tuple((weakref.ref(optimizer), steps) for optimizer, steps in _steps.items()
                 if steps and (model in _bound.get(optimizer, ()) or any(
                     id(p) in held for group in optimizer.param_groups for p in group["params"])))


def _adapter_selection(model: nn.Module) -> tuple:
    """Per PEFT adapter layer (LoRA and other tuners, modules_to_save wrappers): its active
    adapters, whether adapters are disabled, which are merged into the base weight, and a LoRA
    layer's scale per adapter (plain values, no weights read; `scaling` read from the
    instance's dict, as a missing one would cost nn.Module.__getattr__)."""
    return tuple((tuple(m.active_adapters), m.disable_adapters,
                  tuple(getattr(m, "merged_adapters", ())),
                  tuple(vars(m).get("scaling", {}).items()))
                 for m in model.modules() if is_tuner_layer(m))
