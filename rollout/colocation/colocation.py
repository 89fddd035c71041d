"""Colocation: give the trainer back the memory the engine holds between rollouts, and take
its new weights in.

`sleep` frees the KV pool and parks the weights (on the host at level 1, nowhere at level 2),
`wake_up` brings them back, `update_weights` copies the trainer's weights in place. Each either
completes or leaves a stated state: a failed sleep leaves the engine awake, a failed wake-up
asleep, a copy failing half way leaves `needs_weights` True.

The engine holds one `Colocation` and calls it inside its own guard (one caller at a time,
Ctrl-C held). What it touches of the engine is named in its constructor: the model stack, the
speculator's drafter (whose pool sleeps with the engine), and what the engine carries across
(rollout/engine/carry.py): sleep and update_weights retract running sequences, which keep
their tokens, and their K/V is recomputed or parked.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..fields import as_int
from ..journal import RollbackFailed
from ..parallel.reshard import ReshardStats, rank_parts
from . import host_heap
from .checksum import Checked, CopyMismatch
from .device_memory import release_cuda_cache
from .weights import buckets, check_tied_embeddings, named_shapes_and_tensors, unwrap


class Sleeper(Protocol):
    """Something else that sleeps and wakes with the engine: its drafter (a draft model)."""

    def memory_held(self) -> int: ...  # its device bytes, counted in the engine's

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


class Carried(Protocol):
    """What the engine carries across sleep and weight updates (rollout/engine/carry.py)."""

    def retract(self) -> None:
        """Every running sequence gives its K/V up (to the prefix cache) and waits again with
        its tokens: before sleep and update_weights."""

    def park(self) -> None:
        """Before the pool is dropped: K/V to keep goes to the host."""

    def unpark(self) -> None:
        """After the pool is back: the parked K/V goes into it again."""

    def forget_cache(self) -> None:
        """After a weight update: the prefix cache's K/V of the old weights goes."""


class Colocation:
    def __init__(self, stack, device: torch.device, carried: Carried,
                 sleepers: Callable[[], list[Sleeper]] = list, lora=None) -> None:
        """`stack`: the engine's ModelStack (rollout/executor/stack.py); `carried`: what the
        engine carries across (above); `sleepers`: what else sleeps and wakes with it;
        `lora`: the engine's unmerged LoRA (rollout/lora/sync.py), which says what a sync
        from a PEFT model copies."""
        self.stack, self.device = stack, device
        self._carried, self._sleepers = carried, sleepers
        self.lora = lora
        self.sleep_level = 0
        self.weights_missing = False
        # Complete update_weights so far: the version the engine's outputs are stamped with.
        self.weights_version = 0
        # The module the weights were last taken from whole (built from, or a complete
        # update_weights from a model): what ColocatedRollout(synced=True) may trust.
        self.weights_from: weakref.ref | None = None
        # The last complete update_weights' result (bytes, seconds, ...), set before it packs.
        self.last_update: dict = {}

    def took_weights_from(self, source) -> None:
        self.weights_from = weakref.ref(unwrap(source)) if isinstance(source, nn.Module) else None

    def holds_weights_of(self, model: nn.Module) -> bool:
        return (not self.weights_missing and self.weights_from is not None
                and self.weights_from() is unwrap(model))

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def check_ready(self) -> None:
        if self.is_sleeping:
            raise RuntimeError("the engine is asleep: call wake_up() first")
        if self.weights_missing:
            served = self.lora is not None and self.lora.status == "unmerged"
            refill = ("update_weights(peft_model): it copies the base and the adapter again"
                      if served else "update_weights(...) with every weight")
            raise RuntimeError(f"the engine's weights are incomplete (sleep(level=2), or an "
                               f"update_weights that failed half way): call {refill} before "
                               f"generating")

    def sleep(self, level: int = 1) -> None:
        level = as_int("level", level, 1, 2)
        if level <= self.sleep_level:
            return
        self._carried.retract()
        try:
            self._carried.park()
            self.stack.sleep(level)
            for sleeper in self._sleepers():
                sleeper.sleep()
        except BaseException:
            lost = self.stack.parking.dropped_any
            self.weights_missing |= lost
            if not self.is_sleeping:
                self._settle(awake=True)
            elif lost:  # deepening lost host copies: asleep at level 2 now
                self.sleep_level = 2
            raise
        # Asleep from here: handing the freed memory back may fail (a CUDA error an earlier
        # kernel left surfaces at the synchronize), and wake_up must still know to wake.
        self.sleep_level = level
        self.weights_missing = self.weights_missing or level == 2
        self._release_freed()

    def _release_freed(self) -> None:
        """Hand the memory freed by a sleep back (to the device, or the host's heap)."""
        if self.device.type == "cuda":
            release_cuda_cache(self.device)
        elif self.device.type == "cpu":
            host_heap.release_freed_blocks()

    def wake_up(self) -> None:
        if not self.is_sleeping:
            return
        try:
            self.stack.wake_up()
            for sleeper in self._sleepers():
                sleeper.wake_up()
            self._carried.unpark()
        except BaseException as e:
            self._settle(awake=False)
            # Asleep again: what the wake-up took is freed, and handed back as a sleep does;
            # the wake-up's failure is the one raised, a failure handing back noted on it.
            try:
                self._release_freed()
            except BaseException as release_error:
                e.add_note(f"handing the memory back after it failed too: {release_error!r}")
            raise
        self.sleep_level = 0

    def _settle(self, awake: bool) -> None:
        """After a failed sleep or wake-up, finish the way back (every part of a stack's
        sleep and wake-up is idempotent); failing here leaves the engine unusable."""
        try:
            if awake:
                self.stack.wake_up()
            else:
                self.stack.sleep(self.sleep_level)
            for sleeper in self._sleepers():
                sleeper.wake_up() if awake else sleeper.sleep()
            if awake:
                self._carried.unpark()
        except BaseException as e:
            raise RollbackFailed("restoring the engine after a failed sleep/wake_up") from e

    def update_weights(self, source, bucket_bytes: int = 256 << 20, full: bool = False) -> dict:
        bucket_bytes = as_int("bucket_bytes", bucket_bytes, 1)
        if self.is_sleeping:
            raise RuntimeError("update_weights: the engine is asleep: call wake_up() first")
        model = self.stack.model
        t0 = time.perf_counter()
        # Served unmerged (a PEFT LoRA model): the adapter and what may have changed of the
        # base (rollout/lora/sync.py); else every weight, adapters merged.
        check_tied_embeddings(source, model.tie_word_embeddings)
        if self.lora is not None and (self.weights_missing or full):
            self.lora.forget()  # sleep(2), a failed copy or asked: the base is copied again
        plan = None if self.lora is None else self.lora.plan(source)
        if plan is None:
            shapes, named = named_shapes_and_tensors(source)
        else:
            shapes, named = plan.shapes, plan.tensors()
        written = model.check_weights(shapes)
        if plan is None and not written:  # (an adapter-only sync may write no base weight)
            named.close()
            raise ValueError("update_weights: source holds no weight of the model (an "
                             "exhausted iterator, or only names the model ties to others)")
        # Pairs carry no adapter: the weights they give are merged ones (TRL's merged sync),
        # and taking them drops an adapter served unmerged, so they must be a whole policy.
        drops_adapter = (plan is None and self.lora is not None
                         and self.lora.status == "unmerged")
        if self.weights_missing or isinstance(source, nn.Module) or drops_adapter:
            # A model is the trainer's whole policy: one that lacks weights the engine serves
            # is another architecture (fewer layers, an untied head), not an update of some.
            # Served unmerged, its whole base counts, not the part this sync sends.
            held = written if plan is None else model.check_weights(plan.base_shapes)
            missing = model.expected_weight_names() - held
            if missing:
                named.close()
                raise ValueError(f"update_weights: {_why_whole(self.weights_missing, source)}; "
                                 f"{len(missing)} missing ({len(held)} given), e.g. "
                                 f"{sorted(missing)[:3]}")
        dtype = model.dtype
        moved, resharding = 0, ReshardStats()
        parts = rank_parts(named, model.rank_parts(shapes), dtype, bucket_bytes, resharding)
        try:
            # the source is checked: running sequences' K/V (from the old weights) goes now
            self._carried.retract()
        except BaseException:
            _abandon(parts, named)
            raise
        # Whether the engine's weights may have changed yet: the source is read as it is
        # copied (a PEFT model merged while read), so a read can fail before the first write
        # and leave the engine exact.
        written = False
        try:
            if self.lora is not None:
                written = True  # (attaching may fail half way)
                written = self.lora.attach(plan, self.stack.backend)
                if written and self.stack.graphs is not None:
                    self.stack.graphs.release()  # captured with the projections' old adapters
            checked = Checked()
            for bucket in buckets(parts, self.device, dtype, bucket_bytes,
                                  separate_host=self.stack.parking.separate_host):
                written = True
                model.load_weights(bucket, local=True, copy=checked.copy)
                checked.verify()
                # In the engine's dtype: a tensor already on the device goes in uncast.
                moved += sum(t.numel() for _, t in bucket) * dtype.itemsize
            if plan is not None:
                written = True
                moved += self.lora.copy(plan)
                self.lora.remember(plan)
        except BaseException as e:
            _abandon(parts, named)
            self.weights_missing = self.weights_missing or written
            if not isinstance(e, Exception) or isinstance(e, (ValueError, CopyMismatch)):
                # KeyboardInterrupt stays what it is, a refused source a ValueError naming it;
                # needs_weights says the rest.
                raise
            if not written:
                raise RuntimeError("update_weights: failed before any weight was written; "
                                   "the engine keeps the weights it had") from e
            raise RuntimeError("update_weights: a copy failed after some weights were "
                               "written; the engine's weights are incomplete and it "
                               "refuses to generate until a complete update_weights") from e
        finally:
            # KV computed by the old weights goes, even when a copy failed half way.
            try:
                self._carried.forget_cache()
            except BaseException:
                # The update did not complete (the packed copies are the old weights'): the
                # next one must copy every weight again.
                self.weights_missing = True
                raise
        self.weights_missing = False
        self.weights_version += 1
        self.took_weights_from(source)
        # What was written, set with the version so that a failure packing the weights below
        # leaves the engine's counters (rollout/engine/colocated.py) agreeing with both.
        self.last_update = {"bytes": moved, "seconds": time.perf_counter() - t0,
                            "exchanged_bytes": resharding.received_bytes,
                            "collectives": resharding.collectives,
                            "adapter_only": plan is not None and plan.adapter_only}
        model.pack_weights()  # an interrupt here leaves the rest to pack at first use
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_update["seconds"] = time.perf_counter() - t0
        return dict(self.last_update)

    def memory_held(self) -> int:
        return self.stack.memory_held() + sum(s.memory_held() for s in self._sleepers())


def _why_whole(weights_missing: bool, source) -> str:
    """Why an update must hold every weight the engine serves."""
    if weights_missing:
        return "after sleep(level=2) or a failed copy every weight is needed"
    if isinstance(source, nn.Module):
        return "a model source must hold every weight the engine serves"
    return ("(name, tensor) pairs carry no adapter, so they replace the adapter served "
            "unmerged and must hold every weight, merged; to update some base weights and "
            "keep the adapter, call update_weights(peft_model)")


def _abandon(parts, named) -> None:
    """An update failed on this rank: under torch.distributed the rest of `parts` is read,
    copying nothing, then the source closed (at once: reading a PEFT model may hold its merge
    open). Where the parts come from DTensor shards, each bucket's exchange is a collective over
    the source's mesh, which the other ranks go on calling (an engine's ranks, and other
    data-parallel engines on the same mesh); this rank joins the rest of them, so that all
    reach the end of the update (where an engine's ranks agree that it failed) instead of
    waiting on each other until the world's timeout. Whether any is to come is not known before
    the source is read (a plain tensor read first, or a failure before the first read, had left
    the rank out of every exchange), so there every source is read to its end; a plain tensor's
    part is a view. Without torch.distributed there is no DTensor and no one to join: a Ctrl-C
    must not wait for the rest of a PEFT model's merges. A failure while reading leaves the
    first one to be reported."""
    if dist.is_available() and dist.is_initialized():
        try:
            for _ in parts:
                pass
        except BaseException:
            pass
    named.close()
