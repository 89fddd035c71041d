"""Where a source's LoRA layers go in the engine's model: each targeted checkpoint linear is a
block of one of our projections (q_proj: the first shard of qkv_proj; Phi-3's fused qkv_proj:
all of it), found through the family's weight table as its base weight is.

`attach` makes the model's projections hold exactly the blocks a layout names (allocating where
a layout changed, detaching where it has none); it is idempotent, so an attach cut short is
finished by the next. `copies` pairs every block's A and B with this rank's part of the
source's tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..models.base import LORA_MODULE
from ..models.layers.linear import MergedLinear, RowParallelLinear
from ..models.layers.lora import LORA_DTYPE, LoraBlock, LoraWeights
from ..models.layers.lora import implementations as lora_implementations
from ..models.layers.packed_linear import Projection
from ..parallel import Concat, Slice
from .source import SourceLora, Unsupported


@dataclass(frozen=True)
class Placed:
    """A source layer at its block, and how this rank's part of its A and B is cut from them
    (None: whole)."""

    source: SourceLora
    block: LoraBlock
    a_cut: Slice | Concat | None
    b_cut: Slice | Concat | None


# Our projection's module path -> its blocks, in row order.
Layout = dict[str, tuple[Placed, ...]]


def place(model, layers: list[SourceLora]) -> Layout:
    """Each source layer at its block of our model; ValueError for a base weight the model
    does not have (or of another shape), Unsupported for one we hold but not as a projection
    that serves LoRA (embeddings, the LM head, MoE experts)."""
    found: dict[str, list[Placed]] = {}
    shapes = [(f"{layer.name}.weight", layer.base_shape) for layer in layers]
    model.check_weights(shapes)  # ValueError naming the weight
    parts = model.rank_parts(shapes)
    for layer in layers:
        weight = f"{layer.name}.weight"
        if model.WEIGHTS.expert(weight) is not None:
            raise Unsupported(f"{layer.name}: LoRA on MoE experts")
        target, shard = model.WEIGHTS.target(weight)
        path = target.rsplit(".", 1)[0]
        module = model.get_submodule(path)
        if not isinstance(module, (MergedLinear, RowParallelLinear)):
            raise Unsupported(f"{layer.name}: the engine holds it as a "
                              f"{type(module).__name__}, which does not serve LoRA")
        # Column-parallel: this rank's output rows of B; row-parallel: its input columns of
        # A (the delta is then a partial sum, all-reduced with the base's).
        cut = parts[weight]
        b_cut = cut if cut is not None and cut.dim == 0 else None
        a_cut = cut if cut is not None and cut.dim == 1 else None
        if shard is None:
            row, rows = 0, module.out_features
        else:
            sizes = module.shard_sizes
            row, rows = sum(sizes[:shard]), sizes[shard]
        block = LoraBlock(row, rows, layer.rank, layer.scale)
        found.setdefault(path, []).append(Placed(layer, block, a_cut, b_cut))
    return {path: tuple(sorted(placed, key=lambda p: p.block.row))
            for path, placed in found.items()}


def blocks_of(module: Projection) -> tuple[LoraBlock, ...] | None:
    return getattr(module, LORA_MODULE).blocks if module.lora_active else None


def attach(model, layout: Layout, backend) -> bool:
    """Make every projection hold the blocks `layout` gives it (none if absent), each delta
    the implementation `backend` (the engine's, rollout/ops/backend.py) chooses; whether any
    projection changed (captured CUDA graphs are then stale)."""
    choice = backend.choose(lora_implementations(backend.pack_weights), LORA_DTYPE)
    changed = False
    for path, module in model.named_modules():
        if not isinstance(module, (MergedLinear, RowParallelLinear)):
            continue
        want = tuple(p.block for p in layout.get(path, ()))
        if blocks_of(module) == (want or None):
            continue
        changed = True
        module.lora_active = False  # before the module goes: never half attached in a forward
        if hasattr(module, LORA_MODULE):
            delattr(module, LORA_MODULE)
        if want:
            setattr(module, LORA_MODULE, LoraWeights(module.in_features, module.out_features,
                                                     want, module.weight.device, choice))
            module.lora_active = True
    return changed


def copies(model, layout: Layout, clear: bool
           ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, destination, source) of every A and B the layout places, the source gathered
    whole if it is a DTensor and cut to this rank's part. `clear`: zero each B first (B is
    block-diagonal: between its blocks it must hold zeros, which a new LoraWeights has and
    weights restored uninitialised after sleep(2) do not)."""
    for path, placed in layout.items():
        lora = getattr(model.get_submodule(path), LORA_MODULE)
        if clear:
            with torch.no_grad():
                lora.b.zero_()
        for p, (dst_a, dst_b) in zip(placed, lora.block_views()):
            yield f"{p.source.name}.lora_A", dst_a, _part(p.source.a, p.a_cut)
            yield f"{p.source.name}.lora_B", dst_b, _part(p.source.b, p.b_cut)


@torch.no_grad()
def _part(tensor: torch.Tensor, cut: Slice | Concat | None) -> torch.Tensor:
    tensor = tensor.detach()
    if hasattr(tensor, "full_tensor"):  # a DTensor (FSDP2): small, gathered whole
        tensor = tensor.full_tensor()
    return tensor if cut is None else cut.take(tensor)
