"""Where a source's LoRA layers go in the engine's model: each targeted checkpoint linear is a
block of one of our projections (q_proj: the first shard of qkv_proj; Phi-3's fused qkv_proj:
all of it), and each targeted stacked expert parameter an adapter of our experts' stack of the
same name (layers/expert_lora.py), found through the family's weight table as its base weight
is.

`attach` makes the model's projections hold exactly the blocks a layout names (allocating where
a layout changed, detaching where it has none); it is idempotent, so an attach cut short is
finished by the next. `copies` pairs every block's A and B with this rank's part of the
source's tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..colocation.weights import whole
from ..models.base import LORA_MODULE
from ..models.layers.expert_lora import ExpertBlock
from ..models.layers.linear import MergedLinear, RowParallelLinear
from ..models.layers.lora import LORA_DTYPE, LoraBlock, LoraWeights
from ..models.layers.lora import implementations as lora_implementations
from ..models.layers.moe import StackedExperts
from ..models.layers.packed_linear import Projection
from ..parallel import Concat, Slice
from .source import SourceLora, Unsupported, expert_a, expert_b


@dataclass(frozen=True)
class Placed:
    """A source layer at its block, and how this rank's part of its A and B is cut from them
    (None: whole)."""

    source: SourceLora
    block: LoraBlock | ExpertBlock
    a_cut: Slice | Concat | None
    b_cut: Slice | Concat | None


# Our projection's module path -> its blocks, in row order.
Layout = dict[str, tuple[Placed, ...]]


def place(model, layers: list[SourceLora]) -> Layout:
    """Each source layer at its block of our model; ValueError for a base weight the model
    does not have (or of another shape), Unsupported for one we hold but not as a projection
    or expert stack that serves LoRA (embeddings, the LM head, the router)."""
    found: dict[str, list[Placed]] = {}
    shapes = [(layer.weight, layer.base_shape) for layer in layers]
    model.check_weights(shapes)  # ValueError naming the weight
    parts = model.rank_parts(shapes)
    for layer in layers:
        if model.WEIGHTS.expert(layer.weight) is not None:
            raise Unsupported(f"{layer.name}: LoRA on one expert's linear (the engine stacks "
                              f"the experts; PEFT's target_parameters adapts the stack)")
        target, shard = model.WEIGHTS.target(layer.weight)
        path, attr = target.rsplit(".", 1)
        module = model.get_submodule(path)
        # Column-parallel: this rank's output rows of B; row-parallel: its input columns of
        # A (the delta is then a partial sum, all-reduced with the base's).
        cut = parts[layer.weight]
        along = None if cut is None else cut.dim % len(layer.base_shape)
        b_cut = cut if along == len(layer.base_shape) - 2 else None
        a_cut = cut if along == len(layer.base_shape) - 1 else None
        if isinstance(module, StackedExperts) and layer.experts:
            block = ExpertBlock(attr, layer.rank, layer.scale)
        elif isinstance(module, (MergedLinear, RowParallelLinear)) and not layer.experts:
            if shard is None:
                row, rows = 0, module.out_features
            else:
                sizes = module.shard_sizes
                row, rows = sum(sizes[:shard]), sizes[shard]
            block = LoraBlock(row, rows, layer.rank, layer.scale)
        else:
            raise Unsupported(f"{layer.name}: the engine holds it as a "
                              f"{type(module).__name__}, which does not serve LoRA")
        found.setdefault(path, []).append(Placed(layer, block, a_cut, b_cut))
    return {path: tuple(sorted(placed, key=_order)) for path, placed in found.items()}


def _order(placed: Placed):
    block = placed.block
    return block.attr if isinstance(block, ExpertBlock) else block.row


def blocks_of(module: Projection | StackedExperts) -> tuple | None:
    if isinstance(module, StackedExperts):
        return module.lora_blocks()
    return getattr(module, LORA_MODULE).blocks if module.lora_active else None


def implementation(backend) -> str:
    """The projections' delta implementation under the engine's `backend`: in the
    batch-invariant mode a row-invariant one ("cpu" or "triton": resolve_backend refused the
    mode where neither runs)."""
    if backend.triton_rows:
        return "triton"  # its kernels' tiles do not depend on the row count (interpreted too)
    implementations = lora_implementations(backend.pack_weights, backend.batch_invariant)
    return backend.choose(implementations, LORA_DTYPE)


# The adapters' tensors are made as plain ones even when a sync runs under inference_mode:
# an inference tensor keeps no version counter (the packed panels would not see its copies
# change) and refuses the in-place copies of a later sync made outside that mode.
@torch.inference_mode(False)
def attach(model, layout: Layout, backend) -> bool:
    """Make every projection and expert stack hold the blocks `layout` gives it (none if
    absent), a projection's delta the implementation `backend` (the engine's,
    rollout/ops/backend.py) chooses; whether any changed (captured CUDA graphs are then
    stale)."""
    choice = implementation(backend)
    changed = False
    for path, module in model.named_modules():
        if not isinstance(module, (MergedLinear, RowParallelLinear, StackedExperts)):
            continue
        want = tuple(p.block for p in layout.get(path, ()))
        if blocks_of(module) == (want or None):
            continue
        changed = True
        if isinstance(module, StackedExperts):
            module.attach_lora(want)
            continue
        module.lora_active = False  # before the module goes: never half attached in a forward
        if hasattr(module, LORA_MODULE):
            delattr(module, LORA_MODULE)
        if want:
            setattr(module, LORA_MODULE, LoraWeights(module.in_features, module.out_features,
                                                     want, module.weight.device, choice,
                                                     backend.batch_invariant))
            module.lora_active = True
    return changed


def copies(model, layout: Layout, clear: bool
           ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, destination, source) of every A and B the layout places, the source gathered
    whole if it is a DTensor and cut to this rank's part. `clear`: zero each projection's B
    first (B is block-diagonal: between its blocks it must hold zeros, which a new LoraWeights
    has and weights restored uninitialised after sleep(2) do not)."""
    for path, placed in layout.items():
        lora = getattr(model.get_submodule(path), LORA_MODULE)
        if isinstance(lora, LoraWeights):
            if clear:
                with torch.no_grad():
                    lora.b.zero_()
            views = lora.block_views()
        else:  # the experts' adapters: each covers its A and B whole
            views = [(lora[p.block.attr].a, lora[p.block.attr].b) for p in placed]
        for p, (dst_a, dst_b) in zip(placed, views):
            experts = p.source.experts
            yield (f"{p.source.name}.lora_A", dst_a,
                   _part(p.source.a, p.a_cut, functools.partial(expert_a, experts=experts)))
            yield (f"{p.source.name}.lora_B", dst_b,
                   _part(p.source.b, p.b_cut, functools.partial(expert_b, experts=experts)))


def held(model, layout: Layout) -> list[torch.Tensor]:
    """Every adapter tensor the layout's modules hold (what a verified copy covers)."""
    out = []
    for path in layout:
        lora = getattr(model.get_submodule(path), LORA_MODULE)
        for module in ([lora] if isinstance(lora, LoraWeights) else lora.values()):
            out += [module.a, module.b]
    return out


@torch.no_grad()
def _part(tensor: torch.Tensor, cut: Slice | Concat | None, view) -> torch.Tensor:
    tensor = whole(tensor.detach())  # a DTensor (FSDP2) adapter: small, gathered whole
    tensor = view(tensor)  # PEFT's layout as ours (experts), before this rank's cut
    return tensor if cut is None else cut.take(tensor)
