"""The custom loop on partial rollouts (recipes/algo/partial.py): the decoupled objective against a
hand computation, runs that carry groups across steps, dynamic sampling, and its config checks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_recipes import TINY, write_config

from rollout import RolloutOutput, SamplingParams
from rollout.requests.outputs import Sample
from rollout_recipes.algo.losses import behaviour_weights, grpo_loss
from rollout_recipes.grpo import main
from rollout_recipes.run.build import engine_config
from rollout_recipes.run.config import RecipeConfig
from rollout_recipes.tasks import NEEDS_EOS, REWARDS


def test_decoupled_loss_by_hand():
    """-w min(r A, clip(r) A) summed over masked tokens / num_tokens, with r = pi / pi_prox and
    w = min(pi_prox / mu, cap), computed token by token in plain Python."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -4.0]], requires_grad=True)
    proximal = torch.tensor([[-1.1, -1.5, -0.5], [-0.3, -2.0, -1.0]])
    behaviour = torch.tensor([[-1.0, -2.5, -0.2], [-2.0, -2.0, -1.0]])
    advantages = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    eps, cap, num_tokens = 0.2, 2.0, 5.0
    weights = behaviour_weights(proximal, behaviour, cap)
    loss, stats = grpo_loss(logprobs, proximal, advantages, mask, num_tokens, eps,
                            weights=weights)
    want, capped = 0.0, 0
    for i in range(2):
        for t in range(3):
            if not mask[i, t]:
                continue
            w = min(math.exp(proximal[i, t] - behaviour[i, t]), cap)
            capped += w == cap
            r = math.exp(logprobs[i, t].item() - proximal[i, t])
            a = advantages[i].item()
            want += -w * min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
    assert loss.item() == pytest.approx(want / num_tokens, rel=1e-6)
    assert capped == 2  # pi_prox / mu = e^1 and e^1.7 are capped at 2
    loss.backward()  # the weights carry no gradient: only the policy's logprobs get one
    assert logprobs.grad is not None and not weights.requires_grad
    # On-policy (pi_prox = mu) every weight is 1 and the loss is the plain one.
    plain, _ = grpo_loss(logprobs, proximal, advantages, mask, num_tokens, eps)
    ones = behaviour_weights(proximal, proximal, cap)
    assert torch.equal(ones, torch.ones_like(ones))
    assert grpo_loss(logprobs, proximal, advantages, mask, num_tokens, eps,
                     weights=ones)[0].item() == plain.item()


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_partial_rollouts_carry_groups_into_later_steps(tmp_path, algo, monkeypatch):
    """over_sample 2: each step trains on prompts_per_step groups while as many again are in
    flight; some steps train on samples started under the previous weights (staleness 1),
    whose behaviour logprobs then differ from the proximal policy's and whose token weights
    pi_prox / mu are not 1. Fresh samples have weight 1 (up to fp32 rounding of the two
    forwards), and the clipped ratio against the proximal policy is 1 in the single
    minibatch. A length reward gives the groups a spread, so the policy does move (every
    sample scored, EOS or not)."""
    monkeypatch.setitem(REWARDS, "exact", lambda completion, answer: float(len(completion) > 2))
    monkeypatch.setitem(NEEDS_EOS, "exact", False)
    out = main(["--config", write_config(tmp_path), "--algo", algo, "--partial_rollouts", "true",
                "--over_sample", "2", "--max_staleness", "3", "--steps", "4",
                "--learning_rate", "1e-2"])
    history = out["history"]
    assert history[-1]["partial/stale_kv_kept_total"] == 0  # carried_kv "recompute"
    assert history[0]["partial/staleness_max"] == 0
    assert history[0]["partial/carried_groups"] == TINY["prompts_per_step"]
    stale = [row for row in history if row["partial/staleness_max"] >= 1]
    fresh = [row for row in history if row["partial/staleness_max"] == 0]
    assert stale and fresh
    for row in fresh:
        # fp32 forwards, the engine's and the trainer's: worst seen 0 from 1 for the weight, a gap
        # of 8.3e-8 (AMD EPYC Zen 3, AVX2), 0 and 6.5e-8 (Intel Xeon, AVX-512); the bounds leave
        # >1000x for other ISAs.
        assert row["is/weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert row["mismatch/logprob_gap_mean"] < 1e-4
    for row in stale:
        # its tokens' weights pi_prox / mu move from 1 (their mean may not: both ways cancel)
        assert max(row["mismatch/ratio_max"] - 1, 1 - row["mismatch/ratio_min"]) > 1e-3
        assert row["mismatch/logprob_gap_mean"] > 1e-3
    for row in history:
        # one minibatch: the ratio to the proximal policy is 1.0 exactly (AMD EPYC Zen 3, AVX2;
        # Intel Xeon, AVX-512)
        assert row["loss/ratio"] == pytest.approx(1.0, abs=1e-5)
        assert 0 < row["is/weight_mean"] <= 2.0 and 0 <= row["is/capped_frac"] <= 1
        assert row["partial/generated_per_trained_token"] > 0
        fractions = (row["partial/staleness_0_frac"] + row["partial/staleness_1_frac"]
                     + row["partial/staleness_2plus_frac"])
        assert fractions == pytest.approx(1.0)
        assert row["engine/asleep_at_optimizer_step"] == 1.0


def test_stale_restarts_are_logged_in_the_step_whose_update_made_them(tmp_path):
    """max_staleness 0: every group still in flight at an update restarts from its prompt.
    The update runs as the step's rollout block opens, before its groups are drawn, so the
    step's count must span it: over the run the logged counts add up to the engine's."""
    out = main(["--config", write_config(tmp_path, eval_size=0, steps=4), "--partial_rollouts",
                "true", "--over_sample", "3", "--max_staleness", "0"])
    logged = [row["partial/stale_restarts"] for row in out["history"]]
    assert logged[0] == 0  # no update before the first draw
    assert sum(logged) == out["engine_stats"]["stale_restarts"] > 0


def test_carried_kv_reaches_the_engine_with_partial_rollouts():
    """--carried_kv park sets EngineConfig.carried_kv for partial rollouts (the engine's tests
    hold what it does: tests/engine/test_carry_park.py)."""
    assert engine_config(RecipeConfig(partial_rollouts=True, carried_kv="park")).carried_kv == "park"


@pytest.mark.parametrize("key", [dict(carried_kv="park"), dict(over_sample=1.5),
                                 dict(over_sample=2.0, carried_kv="park"),
                                 dict(behaviour_weight_cap=5.0), dict(max_staleness=3),
                                 dict(max_staleness=None),
                                 dict(over_sample=2.0, max_staleness=0)])
def test_partial_rollout_keys_without_partial_rollouts_are_refused(key):
    """Without partial rollouts nothing is carried, over-sampled or weighed by its behaviour
    policy: such keys had been ignored. max_staleness is trl_async's bound too."""
    with pytest.raises(ValueError, match=rf"^{', '.join(key)}: take effect with partial"):
        RecipeConfig(**key)
    RecipeConfig(partial_rollouts=True, **key)
    assert RecipeConfig(trainer="trl_async", max_staleness=3).max_staleness == 3


def test_dynamic_sampling_draws_without_dynamic_sampling_are_refused():
    """One rollout call a step without dynamic sampling: the draws had been ignored."""
    with pytest.raises(ValueError, match="^dynamic_sampling_draws: takes effect with "
                                         "dynamic sampling only"):
        RecipeConfig(dynamic_sampling_draws=8)
    assert RecipeConfig(dynamic_sampling=True, dynamic_sampling_draws=8).dynamic_sampling_draws == 8


def test_dynamic_sampling_trains_on_groups_with_signal(tmp_path, monkeypatch):
    """A reward that is the same for every sample of half the prompts (their answers' parity)
    and spread for the others: dynamic sampling drops the uniform groups and draws more, so
    every group trained on has a reward spread."""
    def reward(completion: str, answer: str) -> float:
        return 1.0 if int(answer) % 2 == 0 else float(len(completion) > 2)

    monkeypatch.setitem(REWARDS, "exact", reward)
    out = main(["--config", write_config(tmp_path), "--dynamic_sampling", "true",
                "--dynamic_sampling_draws", "8", "--num_generations", "8"])
    # (a step whose draws held no even answer drops nothing: counted over the run)
    assert sum(row["dynamic/dropped_groups"] for row in out["history"]) >= 1
    for row in out["history"]:
        assert row["reward/groups_with_signal"] == 1.0


class FakeRollout:
    """Engine.rollout / generate on one prompt text for every row, every sample answering "1"
    and EOS (`written`): a group's reward tells which row's answer it was scored against.
    rollout() hands out the groups newest first and carries the oldest (not the order asked);
    `asked` records which dataset row each request id was asked for (the i-th id of a call is
    the i-th row drawn)."""

    def __init__(self, rows_drawn, written: list[int], eos_ids) -> None:
        self.rows_drawn = rows_drawn  # the sampler's row indices, in the order drawn
        self.written = written
        self.asked: dict[str, int] = {}
        self.prompts: dict[str, str] = {}
        self.engine = SimpleNamespace(stats=SimpleNamespace(
            generated_tokens=0, stale_restarts=0, stale_kv_kept=0, parked_tokens=0),
            carried=[], weights_version=1, eos_ids=eos_ids)

    def _output(self, request_id, prompt):
        return RolloutOutput(request_id, prompt, [
            Sample(j, self.written, [-0.1] * len(self.written), "stop", text="1",
                   weights_versions=[1]) for j in range(2)])

    def generate(self, prompts, params):
        return [self._output(f"drawn-{len(self.asked) + i}", p) for i, p in enumerate(prompts)]

    def rollout(self, prompts, params, groups, request_ids):
        for rid, prompt in zip(request_ids, prompts):
            self.asked[rid] = self.rows_drawn.pop(0)
            self.prompts[rid] = prompt
            self.engine.carried.append(rid)
        handed = self.engine.carried[-groups:][::-1]
        del self.engine.carried[-groups:]
        return [self._output(rid, self.prompts[rid]) for rid in handed]


@pytest.mark.parametrize("partial", [True, False])
def test_groups_are_scored_against_their_own_rows_answer(partial):
    """Rows with one prompt and different answers ("1", "2", alternately): each group is scored
    against the answer of the row it was asked for (its request id with partial rollouts, its
    position with generate), however the groups come back; the drawer keeps the answers of
    the groups still carried only."""
    from datasets import Dataset

    from rollout_recipes.algo.partial import GroupDrawer
    from rollout_recipes.run.tiny import char_tokenizer
    from rollout_recipes.tasks.addition import exact_reward
    from rollout_recipes.tasks.base import Task

    answers = ["1", "2"] * 8
    task = Task(Dataset.from_dict({"prompt": ["?"] * 16, "answer": answers}), None, exact_reward)
    drawn = iter(range(16))
    rows_drawn: list[int] = []

    class Sampler:
        def next(self, count):
            rows = [next(drawn) for _ in range(count)]
            rows_drawn.extend(rows)
            return rows

    tok = char_tokenizer("0123456789?")
    fake = FakeRollout(rows_drawn, tok.encode("1") + [tok.eos_token_id],
                       frozenset({tok.eos_token_id}))
    cfg = SimpleNamespace(prompts_per_step=2, partial_rollouts=partial, over_sample=2.0,
                          dynamic_sampling=not partial, dynamic_sampling_draws=1)
    drawer = GroupDrawer(cfg, fake, task, tok, Sampler(), None)
    for _ in range(3):
        first = len(fake.asked) if partial else len(rows_drawn)
        outs, rewards, _ = drawer.draw()
        # position i of a generate() call answers the i-th row drawn for it
        rows = ([fake.asked[out.request_id] for out in outs] if partial
                else rows_drawn[first:first + len(outs)])
        want = [exact_reward("1", answers[row]) for row in rows for _ in range(2)]
        assert rewards == want and len(set(want)) == 2
        assert len(drawer.answers) == len(fake.engine.carried)


def test_drawer_keeps_the_answers_of_the_groups_in_flight_only():
    """The engine ends groups the drawer never gets back: dropped past max_staleness
    (stale_groups "drop"), aborted (abort_rest), or never queued (a refused call). After
    every draw, succeeded or refused, the drawer holds the answers of the carried groups
    exactly, however many steps the run takes."""
    from datasets import Dataset
    from test_carry import PROMPTS, TOK, make, target

    from rollout_recipes.algo.partial import GroupDrawer
    from rollout_recipes.tasks.base import Task

    engine = make("plain", True, max_staleness=0, stale_groups="drop")
    task = Task(Dataset.from_dict({"prompt": PROMPTS, "answer": ["1"] * len(PROMPTS)}), None,
                lambda completion, answer: 0.0)
    drawn = iter(range(10**6))

    class Sampler:
        def next(self, count):
            return [next(drawn) % len(PROMPTS) for _ in range(count)]

    cfg = SimpleNamespace(prompts_per_step=1, partial_rollouts=True, over_sample=3.0,
                          dynamic_sampling=False, dynamic_sampling_draws=1)
    drawer = GroupDrawer(cfg, SimpleNamespace(engine=engine, rollout=engine.rollout), task, TOK,
                         Sampler(), SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=12))

    def in_flight():
        assert engine.carried and sorted(drawer.answers) == sorted(engine.carried)

    drawer.draw()
    in_flight()
    for _ in range(3):  # each update drops the groups that sampled a token before it
        engine.sleep(2)
        engine.wake_up()
        engine.update_weights(target())
        drawer.draw()
        in_flight()
    assert engine.stats.stale_drops > 0
    engine.rollout(groups=0, abort_rest=True)  # over-sample and abort
    drawer.draw()
    in_flight()
    engine.sleep(1)  # asleep, rollout() refuses the call before it queues anything
    with pytest.raises(RuntimeError):
        drawer.draw()
    in_flight()
    engine.wake_up()
    drawer.draw()
    in_flight()
    engine.check_invariants()


@pytest.mark.parametrize("key, value, match", [
    ("over_sample", 0.5, "over_sample"), ("behaviour_weight_cap", 0.5, "behaviour_weight_cap"),
    ("max_staleness", -1, "max_staleness"), ("dynamic_sampling_draws", 0,
                                              "dynamic_sampling_draws"),
    ("carried_kv", "keep", "carried_kv"),
])
def test_bad_partial_values_name_their_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        RecipeConfig(**{key: value})


def test_partial_rollouts_are_the_custom_single_turn_loops():
    with pytest.raises(ValueError, match="partial_rollouts"):
        RecipeConfig(trainer="trl", partial_rollouts=True)
    with pytest.raises(ValueError, match="partial_rollouts"):
        RecipeConfig(task="calculator", partial_rollouts=True)
    with pytest.raises(ValueError, match="dynamic_sampling"):
        RecipeConfig(algo="ppo", dynamic_sampling=True)


def test_colocated_block_keeps_carried_groups_only_with_carry():
    """ColocatedRollout(carry=True) leaves the groups rollout() carries in the sleeping engine
    (a streaming request of the block is aborted as before); without it, leaving aborts them."""
    from test_carry import PARAMS, PROMPTS, make, target

    from trainer_hooks import ColocatedRollout

    engine = make("plain", True)
    with ColocatedRollout(engine, target(), carry=True) as rollout:
        assert len(rollout.rollout(PROMPTS, PARAMS, groups=2)) == 2
        stray = engine.add_request(PROMPTS[0], PARAMS[0])
    assert engine.is_sleeping and len(engine.carried) == 3
    assert stray not in engine.running_requests
    with ColocatedRollout(engine, target(), carry=True) as rollout:
        assert len(rollout.rollout(groups=1)) == 1
    assert len(engine.carried) == 2
    with ColocatedRollout(engine, target()) as rollout:
        rollout.rollout(groups=1)
    assert engine.carried == [] and not engine.running_requests
    engine.check_invariants()


@pytest.mark.parametrize("flags, importance_ratio", [
    ([], "untruncated"), (["--top_k", "3", "--importance_ratio", "full_policy"], "full_policy")])
def test_trl_async_recipe_trains_on_the_engine(tmp_path, monkeypatch, flags, importance_ratio):
    """`--trainer trl_async`: TRL's AsyncGRPOTrainer with the engine's worker, 2 steps on the
    built-in task (TRL's GPU-only attention kernel stood in for by a torch reference, as in
    test_trl_async.py), the held-out set scored before and after. `--importance_ratio
    full_policy` reaches the worker (it had been ignored); without truncation the sampling
    logprobs are the untruncated ones, which the worker sends. A step trains prompts_per_step
    groups' samples (TRL's fixed-count batches: under its default token budget the count had
    followed max_model_len, 4-6 samples here, a group split across steps)."""
    pytest.importorskip("trl.experimental.async_grpo")
    import flash_varlen

    from trainer_hooks import trl_async

    flash_varlen.install(monkeypatch)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    built = []
    build = trl_async.engine_async_grpo
    monkeypatch.setattr(trl_async, "engine_async_grpo",
                        lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    out = main(["--config", write_config(tmp_path), "--trainer", "trl_async", *flags])
    assert built[0].rollout_worker.importance_ratio == importance_ratio
    # 16 samples a step in forwards of micro_batch_size 8: gradient accumulation over 2 (TRL
    # had taken all 16 in one forward), the step's count unchanged (below)
    assert (built[0].args.per_device_train_batch_size,
            built[0].args.gradient_accumulation_steps) == (TINY["micro_batch_size"], 2)
    assert [row["step"] for row in out["history"]] == [1, 2]
    for row in out["history"]:
        assert 0 <= row["reward/mean"] <= 1 and row["sample/staleness_max"] <= 1
        assert row["batch/samples_per_step"] == pytest.approx(  # (TRL sums it in floats)
            TINY["prompts_per_step"] * TINY["num_generations"])
    assert 0 <= out["accuracy_before"] <= 1 and 0 <= out["accuracy_after"] <= 1
    assert out["engine_stats"]["generated_tokens"] > 0
    with pytest.raises(ValueError, match="trl_async"):
        RecipeConfig(trainer="trl_async", algo="ppo")
