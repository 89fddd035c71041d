"""The engine's side of LoRA served unmerged: whether a source is served that way, what its
projections hold, and what each update_weights must copy.

A sync copies the adapter's A and B, every trainable weight (`requires_grad`: modules_to_save
copies, anything the trainer unfroze; a fused optimizer may write those without bumping their
version counters), and each frozen base weight only if it is not the very tensor, at the same
storage and version, that the engine last copied: so after the first sync only the adapter
crosses (a write through `.data` moves no counter: `update_weights(..., full=True)` forgets
what was copied, so the base crosses again). What was copied is remembered only once a sync
completes; a sync that fails (or an engine that lost its weights at sleep(2)) forgets it all,
so the next sync copies the base again.

A weight PEFT adapts as a parameter (`target_parameters`: the MoE experts' stacks) is compared
by its bits instead of its version (checksum.bit_sum, one read of it on its device): PEFT's
forward puts a parametrization on it and takes it off, and torch's register_parametrization
sets the tensor to itself, which bumps its version at every forward without changing a value.
A write that keeps the sum of its 32-bit words (a permutation of its values) is not seen
there.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef  # imported by torch itself

from ..colocation.checksum import bit_sum, copy_all_verified
from ..colocation.weights import check_tensor
from ..models.layers.moe import StackedExperts
from .layout import Layout, Placed, attach, copies, held, place
from .source import SourceLora, Unsupported, is_peft_lora, read_source


@dataclass
class SyncPlan:
    layout: Layout
    # (HF name, parameter) of the base weights this sync copies, and of all of them.
    send: list[tuple[str, torch.nn.Parameter]]
    base: list[tuple[str, torch.nn.Parameter]]
    keys: dict[str, tuple]  # HF name -> _key of each frozen base weight, at planning

    @property
    def shapes(self) -> list[tuple[str, torch.Size]]:
        return [(name, p.shape) for name, p in self.send]

    @property
    def base_shapes(self) -> list[tuple[str, torch.Size]]:
        return [(name, p.shape) for name, p in self.base]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        # Detached only: a DTensor stays one, re-sharded to this rank's part by update_weights.
        return ((name, p.detach()) for name, p in self.send)

    @property
    def adapter_only(self) -> bool:
        return len(self.send) < len(self.base)


def _key(param: torch.nn.Parameter, by_bits: bool) -> tuple:
    """What tells the tensor copied from another, or from itself changed: the parameter, its
    storage by a weak reference (an address alone is handed out again: two `p.data = ...`
    swaps can put the second at the first one's freed address, and a held weak reference
    keeps the storage's record, so no later storage is taken for it), its address within it,
    and its version counter, or its bits where no counter helps (a parametrized weight; an
    inference tensor, which keeps none)."""
    bits = by_bits or param.is_inference()
    state = int(bit_sum(param.detach())) if bits else param._version
    return (weakref.ref(param), StorageWeakRef(param.untyped_storage()), param.data_ptr(),
            state)


class LoraSync:
    def __init__(self, model, mode: str, batch_invariant: bool = False) -> None:
        self.model, self.mode, self.batch_invariant = model, mode, batch_invariant
        # How the source of the last sync that took effect is served: "unmerged", "merged:
        # <why>" or None (not a PEFT model, or lora="merged"); set when that sync changes what
        # the projections hold (attach), so a sync refused before has left it as it was.
        self.status: str | None = None
        self._next_status: str | None = None  # the planned sync's, until it attaches
        self._copied: dict[str, tuple] = {}  # HF name -> _key of the frozen tensor copied
        # _place's last key, and its layout as (HF name of the source's weight, Placed less
        # its source) pairs
        self._placed: tuple[tuple, dict[str, tuple[tuple[str, Placed], ...]]] | None = None

    def plan(self, source) -> SyncPlan | None:
        """What a sync from `source` copies, checked from metadata; None when it is not
        served unmerged (the caller reads it merged). ValueError for a bad adapter, and for
        one that cannot be served unmerged when the mode is "unmerged"."""
        if self.mode == "merged" or not is_peft_lora(source):
            self._next_status = None
            return None
        try:
            layers, base = read_source(source)
            layout = self._place(layers)
            if self.batch_invariant and any(
                    isinstance(self.model.get_submodule(path), StackedExperts) for path in layout):
                raise Unsupported("LoRA on the MoE experts in the batch-invariant mode (served "
                                  "unmerged with torch.mm, whose rows round with the row count)")
        except Unsupported as e:
            if self.mode == "unmerged":
                raise ValueError(f"lora='unmerged': {e}; it cannot be served unmerged (lora="
                                 f"'auto' or 'merged' merges it into the weights)") from None
            self._next_status = f"merged: {e}"
            return None
        send, keys = [], {}
        parametrized = {layer.weight for layer in layers if layer.parametrized}
        for name, param in base:
            check_tensor(name, param)
            if not param.requires_grad:
                keys[name] = _key(param, name in parametrized)
            last = self._copied.get(name)
            if (param.requires_grad or last is None or last[0]() is not param
                    or last[1:] != keys[name][1:]):
                send.append((name, param))
        return SyncPlan(layout, send, base, keys)

    def _place(self, layers: list[SourceLora]) -> Layout:
        """place(), reused while the adapter's names, shapes and scales stay those it was
        computed for (every sync of a training run): only the source tensors are new."""
        key = tuple((x.weight, x.base_shape, x.a.shape, x.b.shape, x.scale) for x in layers)
        if self._placed is None or self._placed[0] != key:
            # Kept, the sources would pin the first PeftModel's adapter (and its gradients) for
            # the engine's life once the trainer syncs from another one and drops it.
            self._placed = key, {path: tuple((p.source.weight, dataclasses.replace(p, source=None))
                                             for p in placed)
                                 for path, placed in place(self.model, layers).items()}
        by_weight = {x.weight: x for x in layers}
        return {path: tuple(dataclasses.replace(p, source=by_weight[weight])
                            for weight, p in placed)
                for path, placed in self._placed[1].items()}

    def attach(self, plan: SyncPlan | None, backend) -> bool:
        """The projections hold the plan's adapter (none without a plan), its delta the
        implementation the engine's `backend` chooses; whether that changed any (captured CUDA
        graphs are then stale)."""
        if plan is None:
            self.forget()
            self.status = self._next_status
        return attach(self.model, {} if plan is None else plan.layout, backend)

    def copy(self, plan: SyncPlan) -> int:
        """Copy the plan's adapter into the attached projections, verified as a whole
        (rollout/colocation/checksum.py); the bytes written (in the engine's adapter dtype,
        whatever the source's)."""
        # A full sync follows a sleep(2) or a failed copy: what B holds between blocks is then
        # unknown. After a complete sync, only copies into the blocks ever write it.
        pairs = list(copies(self.model, plan.layout, clear=not plan.adapter_only))
        copy_all_verified(pairs, held(self.model, plan.layout))
        return sum(dst.numel() * dst.element_size() for _, dst, _ in pairs)

    def remember(self, plan: SyncPlan) -> None:
        """After a complete sync: the frozen weights are the engine's now."""
        self._copied = dict(plan.keys)
        self.status = "unmerged"

    def forget(self) -> None:
        self._copied.clear()
