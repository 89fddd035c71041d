"""The tool-use recipe (recipes/tools.py): multi-turn episodes trained on their environment mask.
Each piece against an independent reference (GAE as a per-row loop, batch positions written out
by hand, gradients by autograd), then 2 RL steps of the recipe on the tiny model."""

import math

import pytest
import torch

from rollout_recipes.algo.advantages import episode_gae, gae
from rollout_recipes.algo.batch import build_episode_batch
from rollout_recipes.algo.logprobs import token_logprobs
from rollout_recipes.algo.losses import grpo_loss, ppo_loss
from rollout_recipes.algo.warmstart import encode_examples
from rollout_recipes.run.config import RecipeConfig
from rollout_recipes.run.config_file import load_config
from rollout_recipes.run.tiny import char_tokenizer, tiny_llama
from rollout_recipes.tasks import calculator, load_task
from rollout_recipes.tools import CONFIG, main
from rollout.agent import Episode

TOK = char_tokenizer(calculator.ALPHABET)


def naive_gae(rewards, values, mask, gamma, lam):
    """Textbook GAE on each row's model tokens taken out on their own (environment tokens
    dropped, so they are no time step), scattered back; returns = advantages + values."""
    advantages = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[i, t] > 0]
        running = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_value = values[i, steps[k + 1]] if k + 1 < len(steps) else 0.0
            running = rewards[i, t] + gamma * next_value - values[i, t] + gamma * lam * running
            advantages[i, t] = running
    return advantages, (advantages + values) * mask


def test_episode_gae_is_gae_on_a_contiguous_mask():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
    mask = torch.zeros(3, 9)
    mask[0, 2:7], mask[1, 0:9], mask[2, 4:5] = 1, 1, 1  # prompt before, padding after
    for got, want in zip(episode_gae(rewards, values, mask, 0.9, 0.8),
                         gae(rewards, values, mask, 0.9, 0.8)):
        torch.testing.assert_close(got, want)


def test_episode_gae_skips_environment_tokens():
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(2, 12, generator=g), torch.randn(2, 12, generator=g)
    mask = torch.tensor([[0, 1, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0],
                         [0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 1, 0]], dtype=torch.float32)
    got = episode_gae(rewards, values, mask, 0.95, 0.9)
    want = naive_gae(rewards, values, mask, 0.95, 0.9)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # Not plain GAE: that one stops the return at the first environment token.
    assert not torch.allclose(got[0], gae(rewards, values, mask, 0.95, 0.9)[0])


def two_episodes():
    """Prompt 0: [5, 6, 7], then model 10 11, environment 15 16, model 12; prompt 1: [5, 6],
    then model 13 (ids of TOK's vocabulary). The env logprobs are garbage: the batch must not
    carry them."""
    a = Episode([5, 6, 7], [10, 11, 15, 16, 12], [1, 1, 0, 0, 1], [-0.1, -0.2, 7.0, -9.0, -0.3])
    b = Episode([5, 6], [13], [1], [-0.5])
    return [[a], [b]]


def test_episode_batch_positions_by_hand():
    batch = build_episode_batch(two_episodes(), [1.0, 0.0], pad_id=0,
                                device=torch.device("cpu"))
    assert batch.input_ids.tolist() == [[5, 6, 7, 10, 11, 15, 16, 12], [5, 6, 13, 0, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]]
    # Column j scores input j + 1: 10 is predicted at column 2 (from 7), 12 at column 6.
    assert batch.mask.tolist() == [[0, 0, 1, 1, 0, 0, 1], [0, 1, 0, 0, 0, 0, 0]]
    torch.testing.assert_close(batch.old_logprobs, torch.tensor(
        [[0, 0, -0.1, -0.2, 0, 0, -0.3], [0, -0.5, 0, 0, 0, 0, 0]]))
    assert batch.group.tolist() == [0, 1] and batch.episodic
    assert batch.completion_lengths.tolist() == [3, 1]  # model tokens only


def test_truncated_episode_batch_holds_the_sampling_logprobs_at_model_tokens():
    """Under a truncating sampler an episode batch's behaviour logprobs are the sampled
    distribution's, at model tokens only (the trainer then decouples: custom_loop.py)."""
    (a,), (b,) = two_episodes()
    a.sampling_logprobs = [-0.05, -0.1, 3.0, -4.0, -0.2]  # env entries: garbage, never read
    b.sampling_logprobs = [-0.25]
    batch = build_episode_batch([[a], [b]], [1.0, 0.0], pad_id=0, device=torch.device("cpu"),
                                behaviour="sampling")
    # Column j scores input j + 1 (test_episode_batch_positions_by_hand)
    torch.testing.assert_close(batch.old_logprobs, torch.tensor(
        [[0, 0, -0.05, -0.1, 0, 0, -0.2], [0, -0.25, 0, 0, 0, 0, 0]]))


def test_loss_gradient_is_zero_at_environment_tokens():
    """Through a real model: no logit that predicts an environment token (nor padding) gets
    gradient, from the GRPO loss or from PPO's policy and value losses; model tokens do."""
    batch = build_episode_batch(two_episodes(), [1.0, 0.0], pad_id=0,
                                device=torch.device("cpu"))
    model = tiny_llama(TOK, seed=0, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1)
    num_tokens = batch.mask.sum()
    values = torch.randn(2, 7, requires_grad=True)
    # The behaviour policy and the old values are the current ones (ratio 1, value change 0):
    # no clip zeroes a model token's gradient.
    losses = {
        "grpo": lambda lp: grpo_loss(lp, lp.detach(), torch.tensor([1.0, -1.0]),
                                     batch.mask, num_tokens, 0.2)[0],
        "ppo": lambda lp: ppo_loss(lp, lp.detach(), values, values.detach(),
                                   torch.ones(2, 7), torch.randn(2, 7), batch.mask,
                                   num_tokens, 0.2, 0.2, 0.5)[0]}
    for name, loss_of in losses.items():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logits.retain_grad()
        values.grad = None
        loss_of(token_logprobs(logits, batch.input_ids, 1.0)).backward()
        per_position = logits.grad[:, :-1].abs().sum(-1)  # [N, L-1], target space
        trained = batch.mask > 0
        assert (per_position[~trained] == 0).all(), name
        assert (per_position[trained] > 0).all(), name
        assert (logits.grad[:, -1] == 0).all(), name  # the last position predicts nothing
        if name == "ppo":
            assert (values.grad[~trained] == 0).all() and (values.grad[trained] != 0).all()


def test_calculator_answers_calls():
    env = calculator.Calculator()
    # The engine leaves the stop string out of a turn's text; with it, the call reads the same.
    for text in ("<c>1234+567", "<c>1234+567</c>", "12<c>1+1</c>x<c>1234+567"):
        step = env.step([], text)
        assert (step.observation, step.done, step.reward) == ("<r>1801</r>", False, 0.0)
    # A turn without a call is the answer: the episode ends, the environment gives no reward.
    for text in ("1801", "", None):
        step = env.step([], text)
        assert step.done and step.observation is None and step.reward == 0.0


@pytest.mark.parametrize("text", ["<c>", "<c>12", "<c>12+", "<c>+3", "<c>1+2+3", "<c>1-2",
                                  "<c>a+b", "<c> 1+2", "<c>1234567890+1"])
def test_calculator_malformed_call_gets_an_empty_result(text):
    step = calculator.Calculator().step([], text)
    assert (step.observation, step.done) == ("<r></r>", False)


def test_calculator_reward_scores_the_final_answer():
    cfg = RecipeConfig(task="calculator", train_size=50, eval_size=10)
    task = load_task(cfg)
    assert task.reward("<c>12+34</c><r>46</r>46", "46") == 1.0
    assert task.reward("<c>12+34</c><r>46</r>47", "46") == 0.0
    assert task.reward("<c>12+34</c><r>46</r>", "46") == 0.0  # the result alone is no answer
    assert task.reward("46", "46") == 1.0  # no call: the whole completion
    # Scored from the episode's tokens, the answer needs its EOS (cut short: wrong).
    episode = TOK.encode("<c>12+34</c><r>46</r>46")
    assert task.score(TOK, episode + [TOK.eos_token_id], "46", {TOK.eos_token_id}) == 1.0
    assert task.score(TOK, episode, "46", {TOK.eos_token_id}) == 0.0
    # Held-out sums are never trained on.
    train = set(zip(task.train["prompt"], task.train["answer"]))
    assert not train & set(zip(task.eval["prompt"], task.eval["answer"]))
    for prompt, answer in train:
        a, b = map(int, prompt.rstrip("=").split("+"))
        assert 100 <= min(a, b) and max(a, b) <= 9999 and a + b == int(answer)


def test_warmstart_demonstration_masks():
    """The call and the answer (and EOS) are trained on, the environment's result is not."""
    task = load_task(RecipeConfig(task="calculator", train_size=50, eval_size=10))
    ids, attention, mask = encode_examples(task, TOK, ["12+34=", "5+6="], ["46", "11"],
                                           torch.device("cpu"))
    row, m = ids[0].tolist(), mask[0].tolist()
    assert TOK.decode(row[:attention[0].sum()]) == "12+34=<c>12+34</c><r>46</r>46<eos>"
    want = [0] * 6 + [1] * len("<c>12+34</c>") + [0] * len("<r>46</r>") + [1] * 3
    assert m == want
    assert mask[1].sum() == len("<c>5+6</c>") + len("11") + 1  # padded row: same rule
    # Without the tool, the demonstration is the bare answer, as in any single-turn task.
    plain = load_task(RecipeConfig(task="calculator", tools=False, train_size=50, eval_size=10))
    ids, _, mask = encode_examples(plain, TOK, ["12+34="], ["46"], torch.device("cpu"))
    assert TOK.decode(ids[0]) == "12+34=46<eos>" and mask[0].tolist() == [0] * 6 + [1] * 3
    assert plain.environment is None and not plain.stop


@pytest.mark.parametrize("key, value, match", [
    ("max_turns", 0, "max_turns"),
    ("max_episode_tokens", 0, "max_episode_tokens"),
    ("env_timeout", 0, "env_timeout"),
    ("env_timeout", "soon", "env_timeout"),
    ("warmstart_examples", 0, "warmstart_examples"),
    ("tools", "yes", "tools"),
    ("max_turns", 2.5, "max_turns"),
    ("task", "chess", "task"),
    ("trainer", "trl", "trainer"),  # the calculator's episodes run in the custom loop
])
def test_tool_config_errors_name_their_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        load_config(CONFIG, {key: value})


def test_calculator_sizes_are_checked():
    with pytest.raises(ValueError, match="train_size"):
        calculator.sums(10**8, 10, seed=0)


# The recipe on a model small enough for a step to take a fraction of a second; the warm start
# is long enough to teach it to open and close calls, so episodes have environment tokens.
TINY = ["--tiny_model", "{hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
        "num_key_value_heads: 1}", "--train_size", "256", "--eval_size", "16",
        "--warmstart_steps", "40", "--warmstart_batch_size", "16", "--warmstart_lr", "3e-3",
        "--warmstart_examples", "null", "--steps", "2", "--eval_every", "0",
        "--prompts_per_step", "4", "--num_generations", "4", "--kv_cache_tokens", "2048",
        "--max_num_seqs", "64", "--micro_batch_size", "8", "--wandb", "false",
        "--plot", "false", "--progress", "false"]


# grpo: both runs, the tool's and the baseline's (single-turn, no tool); ppo: the tool's; a
# truncating sampler: episodes train on the decoupled loss (custom_loop.py).
@pytest.mark.parametrize("args", [["--algo", "grpo"], ["--algo", "ppo", "--tools", "true"],
                                  ["--algo", "grpo", "--tools", "true", "--top_p", "0.7"]])
def test_tools_recipe_two_steps(tmp_path, monkeypatch, args):
    monkeypatch.setenv("WANDB_MODE", "offline")
    threads = torch.get_num_threads()
    try:
        out = main(TINY + ["--output_dir", str(tmp_path)] + args)
    finally:
        torch.set_num_threads(threads)  # the recipe sets its own
    if "--tools" not in args:
        baseline = out["no_tool"]
        assert [row["step"] for row in baseline["history"]] == [1, 2]
        assert not any(key.startswith("episode/") for key in baseline["history"][0])
        assert "later_turn_cache" not in baseline
    run = out["tool"]
    assert [row["step"] for row in run["history"]] == [1, 2]
    for row in run["history"]:
        for key in ("episode/turns", "episode/length", "episode/env_tokens", "episode/done",
                    "episode/aborted", "reward/mean", "loss/loss", "loss/ratio"):
            assert math.isfinite(row[key]), key
        assert row["episode/env_tokens"] > 0 and row["episode/turns"] > 1
        assert row["episode/aborted"] == 0
        # One optimizer step per rollout, so the trainer's logprobs at model tokens are the
        # engine's: the mask lines up with the tokens the engine sampled. Under top_p the
        # ratio is the trainer's to its own policy at the step's start, and pi_prox / mu (the
        # kept mass) each model token's weight.
        assert row["loss/ratio"] == pytest.approx(1.0, abs=1e-4)
        if "--top_p" in args:
            assert row["loss/clip_frac"] == 0 and row["is/weight_mean"] < 0.999
        assert row["completion/mean_length"] < row["episode/length"]  # env tokens not counted
    assert 0 <= run["accuracy_before"] <= 1 and 0 <= run["accuracy_after"] <= 1
    later = run["later_turn_cache"]
    assert later["later_turns"] > 0 and 0 < later["hit_rate"] <= 1
