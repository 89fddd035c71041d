"""One call per training step for custom trainers:

    with ColocatedRollout(engine, model) as rollout:
        outs = rollout.generate(prompts, params)
    loss.backward(); optimizer.step()       # the engine is asleep: its memory is free

Entering wakes the engine and syncs the weights when the trainer changed them since the last
sync; leaving (also on error) aborts whatever is still running, drops the outputs step() has not
returned (collect a streaming request's inside its block) and puts the engine to sleep, except,
with `carry=True`, the groups `rollout()` carries into the next step (partial rollouts:
docs/partial-rollouts.md), which sleep keeps.
Blocks nest (an evaluation helper that opens its own block inside the step's, or two wrappers
sharing one engine): only the outermost block wakes, aborts and puts the engine to sleep. Blocks
nested on one engine serve one model (its weights are the engine's): a block for another model
inside an open one is refused. Blocks of different engines nest freely.
"""

from __future__ import annotations

import time
import weakref

from torch import nn

from rollout import Engine
from rollout.fields import as_bool, as_int
from rollout.colocation.weights import unwrap, watch_optimizer, weights_version

# The (unwrapped) models of the open blocks per engine, outermost first, across every
# ColocatedRollout that shares it.
_OPEN: weakref.WeakKeyDictionary[Engine, list[nn.Module]] = weakref.WeakKeyDictionary()


class ColocatedRollout:
    def __init__(self, engine: Engine, model: nn.Module, sleep_level: int = 1,
                 gather=None, synced: bool = True, optimizer=None, carry: bool = False) -> None:
        """`gather`: optional context-manager factory that materialises sharded parameters
        (DeepSpeed ZeRO-3 / FSDP), e.g. trl's unwrap_model_for_generation bound to the
        accelerator; weights are read inside it. `synced=False` when the engine may not hold
        the model's current weights (built earlier, or before DDP broadcast rank 0's weights,
        which need not bump version counters): the first entry then syncs unconditionally, as
        it does where the engine's weights did not come from this model (built from another
        module or a path: `Engine.holds_weights_of`).
        `optimizer`: the trainer's optimizer, whose steps then count as weight changes even
        where its kernels bump no version counter (fused AdamW; see `watch`). `carry`: leaving
        keeps the groups `rollout()` carries (Engine.carried) instead of aborting them; streaming
        requests end either way."""
        if not isinstance(engine, Engine):
            raise ValueError(f"engine must be an Engine, got {type(engine).__name__}")
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be the trainer's torch.nn.Module, got "
                             f"{type(model).__name__}")
        if gather is not None and not callable(gather):
            raise ValueError(f"gather must be a context-manager factory or None, got "
                             f"{type(gather).__name__}")
        sleep_level = as_int("sleep_level", sleep_level, 1, 2)
        synced = as_bool("synced", synced)
        self.engine, self.model, self.sleep_level, self.gather = engine, model, sleep_level, gather
        self.carry = as_bool("carry", carry)
        synced = synced and engine.holds_weights_of(model)
        self._synced_version: tuple[int, ...] | None = weights_version(model) if synced else None
        # The engine's own version at that sync: a wrapper for another model sharing the
        # engine, or a direct update_weights, moves it, and this model's weights are due again.
        self._engine_version = engine.weights_version
        self.timings: dict[str, float] = {}
        self.synced = False  # whether the last entry copied weights in
        if optimizer is not None:
            self.watch(optimizer)

    def watch(self, optimizer) -> None:
        """Count this optimizer's steps as changes of this block's model's weights
        (rollout.watch_optimizer), whatever it steps: the model's parameters, or fp32 master
        copies written back through `.data` (DeepSpeed ZeRO-1/2), which no counter sees."""
        watch_optimizer(optimizer, self.model)

    def __enter__(self) -> ColocatedRollout:
        model = unwrap(self.model)
        open_models = _OPEN.get(self.engine, [])
        outermost = not open_models
        if not outermost and open_models[0] is not model:
            # Its sync would swap the weights under the enclosing block: the requests that
            # block has in flight, and its calls after this block, would sample this model.
            raise RuntimeError("ColocatedRollout: the engine is open in an enclosing block for "
                               "another model; nested blocks on one engine must serve one "
                               "model: use an engine per model, or open this block after the "
                               "other one is left")
        t0 = time.perf_counter()
        if outermost:
            self.engine.wake_up()
        t1 = time.perf_counter()
        try:
            self.synced = self.sync_weights()
        except BaseException:
            # __exit__ does not run when __enter__ raises: give the memory back here.
            if outermost:
                self.engine.sleep(self.sleep_level)
            raise
        _OPEN.setdefault(self.engine, []).append(model)
        self.timings.update(wake=t1 - t0, sync=time.perf_counter() - t1)
        return self

    def sync_weights(self, force: bool = False) -> bool:
        """Copy the trainer's weights in if they changed (or the engine lost them)."""
        version = weights_version(self.model)
        if (not force and version == self._synced_version and not self.engine.needs_weights
                and self.engine.weights_version == self._engine_version):
            return False
        # forced: every weight, a PEFT model's frozen base too (writes through `.data`)
        if self.gather is None:
            self.engine.update_weights(self.model, full=bool(force))
        else:
            with self.gather(self.model) as gathered:
                self.engine.update_weights(gathered, full=bool(force))
        # Read again: reading can itself bump counters (PEFT's merge/unmerge fallback for DoRA
        # writes the base weights in place), and that must not count as a change next time.
        self._synced_version = weights_version(self.model)
        self._engine_version = self.engine.weights_version
        return True

    def generate(self, prompts, params=None, **kwargs):
        return self.engine.generate(prompts, params, **kwargs)

    def rollout(self, prompts=(), params=None, **kwargs):
        """Engine.rollout: `groups` complete groups, the rest carried (kept with carry=True)."""
        return self.engine.rollout(prompts, params, **kwargs)

    def __exit__(self, exc_type, exc, tb) -> None:
        t0 = time.perf_counter()
        open_models = _OPEN.get(self.engine, [])
        if len(open_models) > 1:
            # An enclosing block still uses the engine (and may have requests in flight).
            open_models.pop()
            self.timings["sleep"] = 0.0
            return
        _OPEN.pop(self.engine, None)
        try:
            if self.carry:
                # Streaming requests end as without carry, complete ones too: kept, a later
                # block's step() would hand one out a step late, its id still taken.
                carried = set(self.engine.carried)
                for request_id in [*self.engine.running_requests, *self.engine.requests.ready]:
                    if request_id not in carried:
                        self.engine.abort(request_id)  # a complete one's output is dropped
            else:
                self.engine.abort_all()
        finally:
            self.engine.sleep(self.sleep_level)
        self.timings["sleep"] = time.perf_counter() - t0
