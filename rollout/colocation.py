"""Colocation: give the trainer back the memory the engine holds between rollouts, and take
its new weights in.

`sleep` frees the KV pool and parks the weights (on the host at level 1, nowhere at level 2),
`wake_up` brings them back, `update_weights` copies the trainer's weights in place. Each either
completes or leaves a stated state: a failed sleep leaves the engine awake, a failed wake-up
asleep, a copy failing half way leaves `needs_weights` True.
"""

from __future__ import annotations

import time

import torch

from . import cpu_heap
from .journal import RollbackFailed
from .parallel.reshard import ReshardStats, rank_parts
from .sleep import release_cuda_cache, tensor_bytes
from .weights import buckets, named_shapes_and_tensors


class Colocation:
    """The Engine's colocation calls (a mixin: it uses the engine's stacks and guard)."""

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    @property
    def needs_weights(self) -> bool:
        """True after sleep(level=2) until update_weights has refilled every weight."""
        return self._weights_missing

    def _check_ready(self) -> None:
        if self.is_sleeping:
            raise RuntimeError("the engine is asleep: call wake_up() first")
        if self._weights_missing:
            raise RuntimeError("the engine's weights are incomplete (sleep(level=2), or an "
                               "update_weights that failed half way): call update_weights(...) "
                               "with every weight before generating")

    def _check_idle(self, what: str) -> None:
        if self._groups:
            raise RuntimeError(f"{what}: {len(self._groups)} requests are still running; "
                               f"let them finish or abort() them first")

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (the prefix cache empties) and park the weights: on host memory
        (level 1) or nowhere (level 2, update_weights must run after wake_up). A sleep that
        fails leaves the engine awake (`needs_weights` says if weights were lost)."""
        with self._entered("sleep"):
            if level not in (1, 2):
                raise ValueError(f"level must be 1 or 2, got {level!r}")
            self._check_idle("sleep")
            if level <= self.sleep_level:
                return
            try:
                self.stack.sleep(level)
                if self.speculator is not None:
                    self.speculator.drafter.sleep()
            except BaseException:
                lost = self.stack.parking.dropped_any
                self._weights_missing |= lost
                if not self.is_sleeping:
                    self._settle_stacks(awake=True)
                elif lost:  # deepening lost host copies: asleep at level 2 now
                    self.sleep_level = 2
                raise
            if self.device.type == "cuda":
                release_cuda_cache(self.device)
            elif self.device.type == "cpu":
                cpu_heap.release_freed_blocks()
            self.sleep_level = level
            self._weights_missing = self._weights_missing or level == 2

    def wake_up(self) -> None:
        """Allocate the KV pool and bring the weights back. A wake-up that fails (e.g. out
        of memory) leaves the engine asleep."""
        with self._entered("wake_up"):
            if not self.is_sleeping:
                return
            try:
                self.stack.wake_up()
                if self.speculator is not None:
                    self.speculator.drafter.wake_up()
            except BaseException:
                self._settle_stacks(awake=False)
                raise
            self.sleep_level = 0

    def _settle_stacks(self, awake: bool) -> None:
        """After a failed sleep or wake-up, finish the way back (every part of a stack's
        sleep and wake-up is idempotent); failing here leaves the engine unusable."""
        try:
            if awake:
                self.stack.wake_up()
            else:
                self.stack.sleep(self.sleep_level)
            if self.speculator is not None and awake:
                self.speculator.drafter.wake_up()
            elif self.speculator is not None:
                self.speculator.drafter.sleep()
        except BaseException as e:
            raise RollbackFailed("restoring the engine after a failed sleep/wake_up") from e

    def update_weights(self, source, bucket_bytes: int = 256 << 20) -> dict:
        """Copy new weights in place: `source` is the trainer's model (DDP/compile/PEFT wrapped
        or not) or (HF name, tensor) pairs. Clears the prefix cache, whose KV came from the
        old weights. Every name, shape and dtype is checked (and meta tensors refused) before
        the first copy, so a bad source raises ValueError and changes nothing; a copy that
        still fails half way leaves `needs_weights` True.

        Under tensor parallelism each rank cuts every source tensor to its part before
        anything moves (rollout/parallel/reshard.py): a full host tensor crosses to the device
        as that part only; DTensor (FSDP2) shards are exchanged between ranks for exactly the
        ranges each needs, never gathered whole. Returns {'bytes' (copied into the weights),
        'seconds', 'exchanged_bytes' (received from other ranks re-sharding DTensors),
        'collectives' (that re-sharding issued)}."""
        with self._entered("update_weights"):
            if self.is_sleeping:
                raise RuntimeError("update_weights: the engine is asleep: call wake_up() first")
            self._check_idle("update_weights")
            t0 = time.perf_counter()
            shapes, named = named_shapes_and_tensors(source, gather=False)
            written = self.model.check_weights(shapes)
            if self._weights_missing:
                missing = self.model.expected_weight_names() - written
                if missing:
                    raise ValueError(f"update_weights: after sleep(level=2) every weight is "
                                     f"needed; {len(missing)} missing, e.g. {sorted(missing)[:3]}")
            dtype = self.model.dtype
            moved, resharding = 0, ReshardStats()
            try:
                parts = rank_parts(named, self.model.rank_parts(shapes), dtype, bucket_bytes,
                                   resharding)
                for bucket in buckets(parts, self.device, dtype, bucket_bytes,
                                      separate_host=self.stack.parking.separate_host):
                    self.model.load_weights(bucket, local=True)
                    moved += sum(t.numel() * t.element_size() for _, t in bucket)
            except BaseException as e:
                named.close()  # at once: reading a PEFT model may hold its merge open
                self._weights_missing = True
                if not isinstance(e, Exception):
                    raise  # KeyboardInterrupt stays what it is; needs_weights says the rest
                raise RuntimeError("update_weights: a copy failed after some weights were "
                                   "written; the engine's weights are incomplete and it "
                                   "refuses to generate until a complete update_weights") from e
            finally:
                # KV computed by the old weights goes, even when a copy failed half way.
                self.kv.clear_cache()
            self._weights_missing = False
            self.model.pack_weights()  # an interrupt here leaves the rest to pack at first use
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return {"bytes": moved, "seconds": time.perf_counter() - t0,
                    "exchanged_bytes": resharding.received_bytes,
                    "collectives": resharding.collectives}

    def memory_held(self) -> int:
        """Bytes of tensors the engine holds on its device (weights and their packed copies,
        KV pool and its per-slot extras, slot table)."""
        tensors = [*self.model.parameters(), *self.model.buffers(), self.pool.buffer,
                   *self.pool.extras.values(),
                   self.pool.free_slots() if self.pool.is_allocated else None,
                   self.stack.table.table]
        return (tensor_bytes(t for t in tensors if t is not None and t.device == self.device)
                + self.model.derived_bytes())

