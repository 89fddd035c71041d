"""A step's groups for the custom trainer under partial rollouts and dynamic sampling.

Partial rollouts (docs/partial-rollouts.md): `over_sample` x prompts_per_step groups are in
flight; `Engine.rollout` returns the first prompts_per_step to complete (carried ones first) and
carries the rest into the next step, across the optimizer step and the weight sync. Dynamic
sampling (DAPO): a group whose rewards are all equal gives GRPO no signal; it is dropped and more
prompts are drawn, up to `dynamic_sampling_draws` calls a step (the last call's groups are kept
whatever their rewards, so a step always trains).

A group is scored against the answer of the row it was drawn for, paired by its request id
(Engine.rollout's request_ids): a carried group comes back steps later, not in the order asked,
and two rows may share a prompt and differ in their answers. generate() returns its groups in
order, so they pair by position.

Trained on, such a batch takes the decoupled objective (losses.py): `decouple` makes the
trainer's logprobs at the start of the step the proximal policy, keeping the engine's as the
behaviour policy, and `behaviour_weight_stats` gives each token's capped weight.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from .batch import RolloutBatch
from .losses import behaviour_weights


class GroupDrawer:
    def __init__(self, cfg, rollout, task, tokenizer, sampler, params) -> None:
        self.cfg, self.rollout, self.engine = cfg, rollout, rollout.engine
        self.task, self.tokenizer, self.sampler, self.params = task, tokenizer, sampler, params
        # The answers of the groups in flight (Engine.carried), by request id.
        self.answers: dict[str, object] = {}
        self._requests = 0  # ids drawn: the same on every rank of an engine, as they must be
        # Over the run so far: a step may generate nothing (its groups completed while carried)
        # or much (it finishes carried groups of later steps), so the ratio is a running one.
        self.generated = self.trained = 0
        # The engine's restart count when the last step's draw ended: an update restarts stale
        # groups as the next step's rollout block opens, before its draw begins.
        self._restarts = rollout.engine.stats.stale_restarts

    def draw(self):
        """(outputs, their samples' rewards flat, metrics) of prompts_per_step groups."""
        cfg, engine = self.cfg, self.engine
        wanted = cfg.prompts_per_step
        in_flight = math.ceil(cfg.over_sample * wanted) if cfg.partial_rollouts else wanted
        draws = cfg.dynamic_sampling_draws if cfg.dynamic_sampling else 1
        generated = engine.stats.generated_tokens
        kept: list = []
        dropped = calls = 0
        while len(kept) < wanted and calls < draws:
            calls += 1
            short = wanted - len(kept)
            new = max(short, in_flight - len(engine.carried)) if cfg.partial_rollouts else short
            rows = self.task.train[self.sampler.next(new)]
            prompts, answers = self.task.encode(self.tokenizer, rows["prompt"]), rows["answer"]
            if cfg.partial_rollouts:
                ids = [f"group-{self._requests + i}" for i in range(len(prompts))]
                self._requests += len(ids)
                self.answers.update(zip(ids, answers))
                try:
                    outs = self.rollout.rollout(prompts, self.params, groups=short,
                                                request_ids=ids)
                    answers = [self.answers[out.request_id] for out in outs]
                finally:
                    self._keep_carried()
            else:
                outs = self.rollout.generate(prompts, self.params)
            for out, answer in zip(outs, answers):
                rewards = [self.task.score(self.tokenizer, s.token_ids, answer, engine.eos_ids)
                           for s in out.samples]
                if cfg.dynamic_sampling and calls < draws and len(set(rewards)) == 1:
                    dropped += 1
                    continue
                kept.append((out, rewards))
        kept = kept[:wanted]
        outs = [out for out, _ in kept]
        self.generated += engine.stats.generated_tokens - generated
        self.trained += sum(len(s.token_ids) for out in outs for s in out.samples)
        restarts, self._restarts = engine.stats.stale_restarts - self._restarts, \
            engine.stats.stale_restarts
        return outs, [r for _, rewards in kept for r in rewards], self._metrics(
            outs, restarts, dropped, calls)

    def _keep_carried(self) -> None:
        """The answers of the groups the engine still carries, no others: it ends groups
        without handing them back (dropped past max_staleness, aborted by abort_rest) and
        refuses a call before it queues its ids, and no output will ever come to pop those."""
        carried = set(self.engine.carried)
        self.answers = {rid: a for rid, a in self.answers.items() if rid in carried}

    def _metrics(self, outs, restarts: int, dropped: int, calls: int) -> dict:
        version = self.engine.weights_version
        # How many versions old each trained sample's first token is (0: this step's weights).
        staleness = Counter(version - s.weights_versions[0] for out in outs for s in out.samples
                            if s.weights_versions)
        count = sum(staleness.values()) or 1
        out = {"partial/carried_groups": len(self.engine.carried),
               "partial/stale_restarts": restarts,
               "partial/generated_per_trained_token": self.generated / max(self.trained, 1),
               # carried_kv "park", over the run: samples gone on from an older weights' K/V
               # after updates, and K/V tokens sleeps parked on the host
               "partial/stale_kv_kept_total": self.engine.stats.stale_kv_kept,
               "partial/parked_tokens_total": self.engine.stats.parked_tokens,
               "partial/staleness_mean": sum(k * v for k, v in staleness.items()) / count,
               "partial/staleness_max": max(staleness, default=0),
               # The histogram in fixed keys (ranks reduce the same keys).
               "partial/staleness_0_frac": staleness[0] / count,
               "partial/staleness_1_frac": staleness[1] / count,
               "partial/staleness_2plus_frac":
                   sum(v for k, v in staleness.items() if k >= 2) / count}
        if self.cfg.dynamic_sampling:
            out |= {"dynamic/dropped_groups": dropped, "dynamic/rollout_calls": calls}
        return out


def decouple(batch: RolloutBatch, proximal: torch.Tensor) -> None:
    """The engine's logprobs (from whichever weights sampled each token) become the behaviour
    policy; `proximal`, the trainer's logprobs before this step's first optimizer step, the
    policy the ratio is clipped against. `proximal` is on the reference's support (the
    trainer's own forward), so it is the KL's policy side too."""
    batch.behaviour_logprobs = batch.old_logprobs
    batch.old_logprobs = proximal * batch.mask


def behaviour_weight_stats(rows: dict, cap: float) -> tuple:
    """(the decoupled objective's token weights, their sums for the is/ metrics) of a
    micro-batch; (None, {}) for an on-policy batch (no behaviour logprobs)."""
    if "behaviour_logprobs" not in rows:
        return None, {}
    mask = rows["mask"]
    weights = behaviour_weights(rows["old_logprobs"], rows["behaviour_logprobs"], cap)
    return weights, {"is_weight": (weights * mask).sum(),
                     "is_capped": ((weights >= cap).float() * mask).sum()}
