"""The engine's colocation calls: sleep, wake-up and weight updates, handing memory back to the
trainer between rollouts. The work is the engine's `colocation`'s (rollout/colocation/
colocation.py); these run it through the engine's guard, carry what is running across it
(carry.py) and probe the weights an update brought (score.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from ..executor.stack import plain_tensors
from ..fields import as_bool, as_int
from ..parallel.agree import agree_max
from .score import check_probe, run_probe

SLEEP_LEVELS_DIFFER = ("were asked to sleep at different levels (each rank must pass the same "
                       "level)")


class ColocationCalls:
    """Mixed into Engine: its `colocation`, `carry`, `config` and `_entered` are used here."""

    @property
    def sleep_level(self) -> int:
        return self.colocation.sleep_level

    @property
    def is_sleeping(self) -> bool:
        return self.colocation.is_sleeping

    @property
    def weights_version(self) -> int:
        """How many complete update_weights the engine has taken (0: the weights it was built
        with); every RolloutOutput carries the version it was generated under."""
        return self.colocation.weights_version

    def holds_weights_of(self, model) -> bool:
        """Whether the engine's weights are, whole, those it last took from this module
        (wrappers peeled): built from it, or its last complete update_weights read it."""
        return self.colocation.holds_weights_of(model)

    @property
    def lora_status(self) -> str | None:
        """How the adapter of the last PEFT model built from or synced with is served:
        "unmerged", "merged: <why not unmerged>", or None (no PEFT model, or
        EngineConfig(lora="merged"))."""
        return self.colocation.lora.status

    @property
    def needs_weights(self) -> bool:
        """True after sleep(level=2) until update_weights has refilled every weight."""
        return self.colocation.weights_missing

    def _enforce_staleness(self) -> None:
        """The staleness bound (EngineConfig.max_staleness) on the groups not yet handed out:
        at each update, and at each rollout() and step() after it (an update whose restarts
        failed still counted)."""
        self.carry.enforce_staleness(self.weights_version, self.config.max_staleness,
                                     self.config.stale_groups)

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (the prefix cache empties) and park the weights: on host memory
        (level 1) or nowhere (level 2, update_weights must run after wake_up). Requests still
        running are carried: they keep their tokens and are re-prefilled after wake-up
        (rollout/engine/carry.py). A sleep that fails leaves the engine awake (`needs_weights`
        says if weights were lost)."""
        with self._entered("sleep"):
            # Every rank at one level: a rank at level 2 alone would refuse to generate
            # (needs_weights) while the others went on to wait for it.
            def check():
                checked = as_int("level", level, 1, 2)
                return [], [checked], checked
            level = self._checked_alike(check, ready=False, differ=SLEEP_LEVELS_DIFFER)[1]
            with self._on_every_rank("sleep"):
                self.colocation.sleep(level)

    def wake_up(self) -> None:
        """Allocate the KV pool and bring the weights back. A wake-up that fails (e.g. out
        of memory) leaves the engine asleep."""
        with self._entered("wake_up"), self._on_every_rank("wake_up"):
            self.colocation.wake_up()

    @plain_tensors  # it packs the weights' derived copies anew, which later updates rewrite
    def update_weights(self, source, bucket_bytes: int = 256 << 20, probe=None,
                       probe_reference=None, full: bool = False) -> dict:
        """Copy new weights in place (docs/colocation.md): `source` is the trainer's model
        (DDP/compile/PEFT wrapped or not) or (HF name, tensor) pairs, checked whole before the
        first copy (a bad one raises ValueError and changes nothing); each copy is verified
        (docs/logprobs.md); a copy failing half way leaves `needs_weights` True. The prefix
        cache empties; running requests are carried (rollout/engine/carry.py). Under tensor
        parallelism each rank takes only its part (rollout/parallel/reshard.py). `probe`
        (token ids): scored under the new weights, against `probe_reference` (the trainer's
        logprobs of its tokens 1..) when given (rollout/engine/score.py). A PEFT LoRA model
        served unmerged (EngineConfig.lora) sends its adapter and trainable weights only, the
        frozen base once (rollout/lora/sync.py); `full` copies its base again too (after
        writes through `.data`, which move no version counter). Returns {'bytes', 'seconds',
        'exchanged_bytes', 'collectives', 'adapter_only'} (+ 'probe_logprobs', 'probe_gap')."""
        with self._entered("update_weights"):
            checked = check_probe(self, probe, probe_reference)
            before, missing = self.weights_version, self.colocation.weights_missing

            def changed() -> bool:  # whether this rank's weights may be other than before
                return (self.weights_version != before
                        or self.colocation.weights_missing and not missing)

            self.carry.begin_update()
            try:
                with self._on_every_rank("update_weights", lambda: self._lose_weights(before),
                                         changed, lambda: self.carry.kept_lost):
                    result = self.colocation.update_weights(source, bucket_bytes,
                                                            as_bool("full", full))
            finally:
                # New weights are in even when what follows the copy failed (packing them):
                # the update counts, with what it wrote, and the staleness bound holds for it.
                if self.weights_version != before:
                    self._count_sync(self.colocation.last_update)
                    self._enforce_staleness()
            if checked is not None:
                result.update(run_probe(self, *checked))
            return result

    def _count_sync(self, update: dict) -> None:
        stats = self._stats
        stats.weight_syncs += 1
        stats.adapter_syncs += update["adapter_only"]
        stats.weight_sync_bytes, stats.weight_sync_seconds = update["bytes"], update["seconds"]

    def _lose_weights(self, version: int) -> None:
        """An update that failed on some rank after some rank wrote a weight: every rank needs
        a complete one, and counts none (all at `version`: the outputs' weights_version stays
        alike across ranks)."""
        self.colocation.weights_missing = True
        self.colocation.weights_version = version

    @contextlib.contextmanager
    def _on_every_rank(self, call: str, on_failure: Callable[[], None] | None = None,
                       changed: Callable[[], bool] | None = None,
                       lost_kv: Callable[[], bool] | None = None) -> Iterator[None]:
        """Under tensor parallelism a sleep, wake-up or update that fails on one rank (out of
        memory, say) fails on every rank, and every rank ends in one state: asleep at the
        deepest level any rank is at, needing weights if any rank lost them (one all-reduce
        at the end; ranks left apart would wait on each other at their next collective).
        `on_failure`: what every rank does then besides, where `changed()` held on some rank
        (an update that wrote a weight anywhere counts on none; one refused on every rank
        before any write leaves them all as they were, as one engine's). `lost_kv()`: this
        rank dropped the K/V its carried samples were to go on from (Carry.forget_cache):
        then every rank drops it (Carry.drop_kept_kv), or the ranks would schedule those
        samples apart."""
        if self.tp.size == 1:
            yield
            return
        try:
            yield
        except BaseException:
            self._settle_ranks(call, True, on_failure, changed, lost_kv)
            raise
        self._settle_ranks(call, False, on_failure, changed, lost_kv)

    def _settle_ranks(self, call: str, failed: bool, on_failure, changed, lost_kv) -> None:
        colocation = self.colocation
        any_failed, level, missing, any_changed, any_lost = agree_max(
            [int(failed), colocation.sleep_level, int(colocation.weights_missing),
             int(changed is None or changed()), int(lost_kv is not None and lost_kv())],
            self.tp, self.device)
        if not any_failed:
            return
        if on_failure is not None and any_changed:
            on_failure()
        if any_lost:
            self.carry.drop_kept_kv()
        if level > colocation.sleep_level:
            colocation.sleep(level)
        colocation.weights_missing = colocation.weights_missing or bool(missing)
        if not failed:
            raise RuntimeError(f"{call}: it failed on another rank of this tensor-parallel "
                               f"engine, so this rank is left as that one is (that rank "
                               f"raised why)")

    def memory_held(self) -> int:
        """Bytes of tensors the engine holds on its device (weights and their packed copies,
        KV pool and its per-slot extras, slot table)."""
        return self.colocation.memory_held()
