"""The training recipes (recipes/): each trainer path for 2 steps on the built-in task, a
2-process launch, config validation, and (slow) the demo's learning claim."""

import importlib
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
import yaml
from floors import tolerance

from rollout_recipes.algo.advantages import gae, group_advantages
from rollout_recipes.grpo import main
from rollout_recipes.run.config import RecipeConfig
from rollout_recipes.run.config_file import load_config, parse_overrides
from rollout_recipes.tasks import REWARDS, exact_reward, math_reward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The built-in task and model, shrunk until a step takes a fraction of a second.
TINY = dict(tiny_model=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1),
            train_size=256, eval_size=16, warmstart_steps=2, warmstart_batch_size=8, steps=2,
            prompts_per_step=4, num_generations=4, max_new_tokens=4, kv_cache_tokens=1024,
            max_model_len=32, max_num_seqs=64, micro_batch_size=8, num_threads=1,
            wandb=False, plot=False, progress=False)

STEP_KEYS = ("reward/mean", "completion/mean_length", "rollout/tokens_per_second",
             "rollout/prefix_cache_hit_rate", "time/rollout", "time/train", "time/weight_sync",
             "memory/engine_awake_bytes", "memory/engine_asleep_bytes",
             "engine/asleep_at_optimizer_step")


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the recipe sets its own


def write_config(tmp_path, **overrides) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, "output_dir": str(tmp_path / "run"), **overrides}))
    return str(path)


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def check_steps(history: list[dict]) -> None:
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        for key in STEP_KEYS:
            assert key in row, key
        assert 0 <= row["reward/mean"] <= 1
        assert row["rollout/tokens_per_second"] > 0
        # 4 samples of each prompt: 3 of every 4 prompt copies come from the radix cache.
        assert row["rollout/prefix_cache_hit_rate"] > 0.5
        assert row["engine/asleep_at_optimizer_step"] == 1.0
        assert row["memory/engine_asleep_bytes"] < row["memory/engine_awake_bytes"]


def test_custom_grpo_two_steps(tmp_path):
    out = main(["--config", write_config(tmp_path), "--beta", "0.05", "--wandb", "true"])
    check_steps(out["history"])
    for row in out["history"]:
        assert row["kl"] >= 0
        # One optimizer step per rollout: the policy still is the behaviour policy, so the
        # trainer's logprobs reproduce the engine's and the importance ratio is 1.
        # Worst seen (AMD EPYC Zen 3, AVX2): ratio 1.0 exactly, ratio_abs_dev and gap mean 8.2e-8,
        # gap max 4.8e-7, prob_error 8.2e-8 from 1, ratio_max 2.4e-7 from 1, kl 2.8e-8; (Intel
        # Xeon, AVX-512) ratio 1.0 exactly, 7.9e-8, 2.4e-7, 7.9e-8, 2.4e-7, kl 1.6e-8; the
        # bounds leave >100x for other ISAs.
        assert row["loss/ratio"] == pytest.approx(1.0, abs=1e-5)
        assert row["loss/ratio_abs_dev"] < 1e-5
        assert row["engine/optimizer_steps"] == 1
        # The rollout-vs-trainer mismatch of the first minibatch (fp32: rounding only).
        assert 0 <= row["mismatch/logprob_gap_mean"] <= row["mismatch/logprob_gap_max"] < 1e-4
        assert row["mismatch/prob_error"] == pytest.approx(1.0, abs=1e-4)
        assert row["mismatch/ratio_min"] <= 1 + 1e-6 and row["mismatch/ratio_max"] >= 1 - 1e-6
        assert abs(row["mismatch/ratio_max"] - 1) < 1e-4 and abs(row["mismatch/kl"]) < 1e-5
    # Every step syncs the weights its last optimizer step made: one more version a step.
    versions = [row["weights/version"] for row in out["history"]]
    assert versions == list(range(versions[0], versions[0] + len(versions))) and versions[0] >= 1
    assert 0 <= out["accuracy_before"] <= 1 and 0 <= out["accuracy_after"] <= 1
    # The same rows went to the JSONL file and to an offline W&B run.
    logged = [r for r in read_jsonl(out["metrics_path"]) if "step" in r]
    assert logged == out["history"]
    runs = [d for d in os.listdir(out["wandb_dir"]) if d.startswith("offline-run-")]
    assert len(runs) == 1
    assert any(f.endswith(".wandb") for f in os.listdir(os.path.join(out["wandb_dir"], runs[0])))


def test_custom_grpo_trains_a_lora_adapter_served_unmerged(tmp_path):
    """lora: the policy is a PEFT model; after the first sync each step's copies only its
    adapter into the engine, and the trainer's logprobs still reproduce the engine's."""
    pytest.importorskip("peft")
    out = main(["--config", write_config(tmp_path), "--lora",
                "{r: 4, lora_alpha: 8, target_modules: all-linear}"])
    check_steps(out["history"])
    synced = [row for row in out["history"] if "weights/sync_bytes" in row]
    stats = out["engine_stats"]  # evaluation and warm start sync too, outside the steps
    assert synced and stats["adapter_syncs"] == stats["weight_syncs"] >= len(synced)
    for row in out["history"]:
        # worst seen: ratio 1.0 exactly, gap max 2.4e-7 (AMD EPYC Zen 3, AVX2; the same on Intel
        # Xeon, AVX-512): >100x left
        assert row["loss/ratio"] == pytest.approx(1.0, abs=1e-5)
        assert row["mismatch/logprob_gap_max"] < 1e-4
    for row in synced:  # the base was loaded when the engine was built, never again
        assert row["weights/adapter_only"] == 1.0
        assert row["weights/sync_bytes"] == synced[0]["weights/sync_bytes"]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_truncated_sampling_on_the_samplers_support_keeps_the_ratio_at_one(tmp_path, algo):
    """top_p = 0.8, one optimizer step per rollout (on-policy): renormalised over the tokens the
    sampler kept, the trainer's logprobs are the engine's sampling logprobs, and every token's
    ratio is 1. Against the untruncated policy ("full_policy") pi / mu lies below 1 by the mass
    the filter cut: the loss is decoupled, its ratio to the trainer's own policy at the step's
    start 1 and pi_prox / mu each token's weight. (Clipped against mu, every token with a
    negative advantage and a cut past clip_eps had been clipped, so got no gradient.)"""
    ratios = {}
    for mode in ("on_support", "full_policy"):
        (tmp_path / mode).mkdir()
        out = main(["--config", write_config(tmp_path / mode), "--algo", algo, "--top_p", "0.8",
                    "--importance_ratio", mode, "--steps", "1"])
        (row,) = out["history"]
        ratios[mode] = row
    on = ratios["on_support"]
    # worst seen: ratio 1.0 exactly, ratio_abs_dev 8.7e-8 (AMD EPYC Zen 3, AVX2); ratio 1 -
    # 3.1e-8, ratio_abs_dev 1.0e-7 (Intel Xeon, AVX-512): ~100x left
    assert on["loss/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert on["loss/ratio_abs_dev"] < 1e-5 and on["loss/ratio_outside"] == 0
    full = ratios["full_policy"]
    assert full["loss/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert full["loss/clip_frac"] == 0 and full["loss/ratio_outside"] == 0
    assert full["is/weight_mean"] < 0.99  # the kept mass, pi_prox / mu


@pytest.mark.parametrize("mode", ["on_support", "full_policy"])
def test_ppo_kl_penalty_is_zero_while_the_policy_is_the_reference(tmp_path, mode):
    """top_p = 0.5: at the first step the policy is the frozen reference, so the KL penalty
    PPO folds into the rewards is 0 up to the engine-trainer rounding, on either importance
    ratio. Its policy side must be on the reference's support: full_policy's behaviour
    logprobs are the truncated distribution's, log(1 / kept mass) above the untruncated
    policy's (0.63 nats a token here)."""
    out = main(["--config", write_config(tmp_path, eval_size=0, warmstart_steps=0), "--algo",
                "ppo", "--beta", "0.1", "--top_p", "0.5", "--importance_ratio", mode,
                "--steps", "1"])
    (row,) = out["history"]
    # the mean of fp32 engine - fp32 trainer-forward logprobs: worst seen 2.1e-8 (AMD EPYC
    # Zen 3, AVX2), 1.1e-8 (Intel Xeon, AVX-512), against 0.63 with the truncated logprobs
    assert row["kl"] == pytest.approx(0.0, abs=1e-5)


def test_minibatches_give_as_many_optimizer_steps_as_asked(tmp_path):
    """6 samples in 4 minibatches (sizes 2, 2, 1, 1), 2 epochs: 8 optimizer steps a rollout
    (torch.chunk would cut 6 into 3 chunks of 2)."""
    out = main(["--config", write_config(tmp_path, eval_size=0), "--prompts_per_step", "3",
                "--num_generations", "2", "--minibatches", "4", "--epochs", "2",
                "--steps", "1"])
    (row,) = out["history"]
    assert row["engine/optimizer_steps"] == 2 * 4


def test_trl_truncated_sampling_on_the_samplers_support(tmp_path):
    """The same through TRL (--trainer trl, RolloutGRPOTrainer): the recipe's top_p reaches
    the engine, and TRL's importance ratio is 1 on the support, pi / mu below 1 without."""
    pytest.importorskip("trl")
    rows = {}
    for mode in ("on_support", "full_policy"):
        (tmp_path / mode).mkdir()
        out = main(["--config", write_config(tmp_path / mode, eval_size=0), "--trainer", "trl",
                    "--top_p", "0.8", "--importance_ratio", mode, "--steps", "1"])
        (rows[mode],) = out["history"]
    on, full = rows["on_support"], rows["full_policy"]
    assert on["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert 1 - 1e-4 < on["sampling/importance_sampling_ratio/min"]
    assert on["sampling/importance_sampling_ratio/max"] < 1 + 1e-4
    assert full["sampling/importance_sampling_ratio/mean"] < 0.99


def test_custom_grpo_minibatches_use_the_importance_ratio(tmp_path, monkeypatch):
    # A 2-step warm start earns no exact answers; a length reward gives the groups a spread,
    # so the first optimizer step moves the policy away from the one that sampled.
    monkeypatch.setitem(REWARDS, "exact", lambda completion, answer: float(len(completion) > 2))
    out = main(["--config", write_config(tmp_path), "--minibatches", "2", "--epochs", "2",
                "--learning_rate", "1e-2", "--plot", "true", "--eval_every", "1"])
    assert [row["eval/accuracy"] for row in out["history"]][-1] == out["accuracy_after"]
    for row in out["history"]:
        assert row["engine/optimizer_steps"] == 4
        assert row["engine/asleep_at_optimizer_step"] == 1.0
        assert row["loss/ratio_abs_dev"] > 1e-4  # later minibatches are off-policy
    assert os.path.getsize(out["plot"]) > 0


def test_custom_ppo_two_steps_with_speculative_rollouts(tmp_path):
    out = main(["--config", write_config(tmp_path), "--algo", "ppo", "--beta", "0.05",
                "--speculative", "{method: ngram, num_speculative_tokens: 2}"])
    check_steps(out["history"])
    for row in out["history"]:
        for key in ("loss/policy", "loss/value", "value/mean", "kl"):
            assert key in row, key
    assert out["engine_stats"]["spec_proposed"] > 0
    assert any(0 <= row.get("rollout/spec_acceptance", -1) <= 1 for row in out["history"])


def test_trl_two_steps(tmp_path):
    """With eval_every 1 the trl trainer scores the held-out set after each RL step, as the
    custom loop does; the last step's score is the accuracy after RL."""
    pytest.importorskip("trl")
    out = main(["--config", write_config(tmp_path, eval_every=1), "--trainer", "trl"])
    check_steps(out["history"])
    for row in out["history"]:
        assert row["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
        assert 0 <= row["eval/accuracy"] <= 1
    assert out["accuracy_after"] == out["history"][-1]["eval/accuracy"]


def test_trl_kl_reference_and_rl_steps_match_the_custom_loop(tmp_path):
    # beta > 0: TRL would reload the reference from the policy's config path (the tiny model
    # has none); the recipe hands it the warm-started policy, as the custom loop's reference.
    # minibatches x epochs: `steps` counts rollouts in both trainers, not optimizer steps.
    pytest.importorskip("trl")
    out = main(["--config", write_config(tmp_path, eval_size=0), "--trainer", "trl",
                "--beta", "0.05", "--minibatches", "2", "--epochs", "2"])
    check_steps(out["history"])  # one row per RL step, each with its own rollout
    for row in out["history"]:
        assert row["kl"] >= 0 and row["engine/asleep_at_optimizer_step"] == 1.0
    assert out["history"][0]["kl"] == pytest.approx(0.0, abs=1e-6)  # reference == policy


def test_trl_kl_reference_with_lora_is_the_warm_started_adapter(tmp_path):
    """lora + beta: TRL keeps a copy of the policy's adapter as its reference ("ref"), so a
    reference of our own would be refused after the model is built and warm-started; the
    reference is then the warm-started policy, as the custom loop's (the base with the adapter
    off would leave out what the warm start trained: a KL > 0 from the first step)."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    out = main(["--config", write_config(tmp_path, eval_size=0, steps=1, warmstart_steps=5),
                "--trainer", "trl", "--beta", "0.05", "--lora",
                "{r: 4, lora_alpha: 8, target_modules: all-linear}"])
    assert out["history"][0]["kl"] == pytest.approx(0.0, abs=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_custom_loop(tmp_path):
    # `accelerate launch --cpu --num_processes 2` starts one process in accelerate 1.x (it
    # wants mpirun for multi-CPU); `--multi_gpu` with no visible GPU starts 2 ranks, and the
    # recipe's Accelerator(cpu=True) joins them over gloo.
    config = write_config(tmp_path)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           os.path.join(ROOT, "recipes", "grpo.py"), "--config", config]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    history = [r for r in rows if "step" in r]
    check_steps(history)
    summary = rows[-1]["summary"]
    assert summary["processes"] == 2
    # Each rank rolled out its own 4 prompts x 4 samples, every step.
    assert summary["engine_stats"]["generated_tokens"] > 0
    assert all(r["rollout/generated_tokens"] > 0 for r in history)


# --- config validation -----------------------------------------------------------------------

def test_unknown_key_in_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="learning_rat"):
        load_config(write_config(tmp_path, learning_rat=1e-3))


def test_unknown_override_is_named(tmp_path):
    with pytest.raises(ValueError, match="num_generation"):
        main(["--config", write_config(tmp_path), "--num_generation", "4"])


@pytest.mark.parametrize("recipe", ["demo", "smollm2_arith", "tools"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_recipes_print_their_help(recipe, flag, capsys):
    """The recipes without argparse (overrides only) answer --help as argparse would: their
    docstring, exit 0 (it had been read as a key missing its value: a ValueError)."""
    module = importlib.import_module(f"rollout_recipes.{recipe}")
    with pytest.raises(SystemExit) as e:
        module.main(["--steps", "1", flag])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(module.__doc__.strip().splitlines()[0]) and "recipes/run/config.py" in out


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        main(["--config", str(tmp_path / "nope.yaml")])


def test_missing_dataset_file(tmp_path):
    cfg = write_config(tmp_path, model=str(tmp_path), dataset=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="dataset"):
        main(["--config", cfg])


@pytest.mark.parametrize("key, value, match", [
    ("algo", "dpo", "algo"), ("trainer", "vllm", "trainer"), ("temperature", -1.0, "temperature"),
    ("steps", 0, "steps"), ("steps", "ten", "steps"), ("num_generations", 1, "num_generations"),
    ("sleep_level", 3, "sleep_level"), ("wandb", "yes", "wandb"), ("dtype", "float17", "dtype"),
    ("tiny_model", {"hidden": 8}, "tiny_model"), ("kv_cache_tokens", 8, "kv_cache_tokens"),
    ("speculative", {"method": "magic"}, "speculative.method"),
    ("speculative", {"k": 4}, "speculative"),
    ("lora", {"rank": 4}, "lora: unknown key"), ("lora", {"r": 0}, "lora.r"),
    ("lora_mode", "fused", "lora_mode"),
    # NaN passes `< 0`; a non-float dtype, a seed numpy refuses, a thread count torch refuses
    # and PPO knobs out of range used to pass and fail later, after the model was built.
    ("beta", float("nan"), "beta"), ("max_grad_norm", float("nan"), "max_grad_norm"),
    ("model_dtype", "int8", "model_dtype"), ("dtype", "int32", "dtype"),
    ("seed", 2**40, "seed"), ("num_threads", -2, "num_threads"), ("vf_coef", -1.0, "vf_coef"),
    ("value_clip", -0.5, "value_clip"), ("clip_eps", float("inf"), "clip_eps"),
    ("tiny_model", {"hidden_size": 0}, "tiny_model.hidden_size"),
    ("max_new_tokens", 64, "max_new_tokens"), ("minibatches", 1000, "minibatches"),
    ("data_seed", -1, "data_seed"), ("data_seed", 2**32, "data_seed"),
    # An infinite KL weight or weight decay makes the first loss NaN; a clip_eps above 1 a
    # negative lower clip bound on the ratio.
    ("beta", math.inf, "beta must be >= 0 and finite"),
    ("weight_decay", math.inf, "weight_decay must be >= 0 and finite"),
    ("clip_eps", 1.5, r"clip_eps must be in \(0, 1\]"),
    # Sizes each >= 1 that transformers refuses together (in the first forward, or at build)
    ("tiny_model", {"num_key_value_heads": 3}, "tiny_model.num_key_value_heads must divide"),
    ("tiny_model", {"num_attention_heads": 2, "num_key_value_heads": 4},
     "tiny_model.num_key_value_heads must divide"),
    # merged with the built-in sizes: 4 heads of 128 unless given
    ("tiny_model", {"num_attention_heads": 3}, "tiny_model.num_key_value_heads must divide"),
    ("tiny_model", {"hidden_size": 30}, r"tiny_model.hidden_size must be a multiple of 2 x"),
    ("tiny_model", {"hidden_size": 36}, r"tiny_model.hidden_size must be a multiple of 2 x"),
    # the built-in model's 64 positions (the engine refused it only once the model was built)
    ("max_model_len", 128, r"max_model_len: 128 is more than the built-in tiny model's context, "
                           r"tiny_model.max_position_embeddings = 64"),
    ("lora", {"r": 4, "lora_alpha": math.inf}, "lora.lora_alpha must be a number > 0 and "
                                               "finite"),
    ("lora", {"lora_alpha": True}, "lora.lora_alpha"),
    ("lora", {"lora_dropout": True}, "lora.lora_dropout"),
    ("lora", {"target_modules": 5}, "lora.target_modules"),
    ("lora", {"target_modules": ["q_proj", 5]}, "lora.target_modules"),
])
def test_bad_values_name_their_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        RecipeConfig(**{key: value})


def test_trl_micro_batches_accumulate_into_the_minibatch():
    from types import SimpleNamespace

    from rollout_recipes.algo.trl_loop import grpo_args

    cpu = SimpleNamespace(device=torch.device("cpu"), mixed_precision="no")
    args = grpo_args(RecipeConfig(trainer="trl", prompts_per_step=4, num_generations=8,
                                  minibatches=2, micro_batch_size=4), cpu)
    # 32 sequences a rollout, 2 optimizer steps of 16, each 4 forward/backward passes of 4
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps,
            args.steps_per_generation, args.generation_batch_size) == (4, 4, 8, 32)
    whole = grpo_args(RecipeConfig(trainer="trl", prompts_per_step=2, num_generations=4,
                                   micro_batch_size=64), cpu)  # more than a minibatch: whole
    assert (whole.per_device_train_batch_size, whole.gradient_accumulation_steps,
            whole.generation_batch_size) == (8, 1, 8)
    # no divisor: the largest that divides the minibatch (96 -> 48 for 64; 20 -> 5 for 8, the
    # values RecipeConfig fills in for the tiny and for a named model)
    for per_step, micro, want in ((96, 64, 48), (20, 8, 5)):
        args = grpo_args(RecipeConfig(trainer="trl", prompts_per_step=per_step // 4,
                                      num_generations=4, micro_batch_size=micro), cpu)
        assert (args.per_device_train_batch_size,
                args.gradient_accumulation_steps) == (want, per_step // want)


@pytest.mark.parametrize("key, value", [("beta", 0.1), ("minibatches", 2), ("epochs", 2),
                                        ("lora", {"r": 4})])
def test_trl_async_refuses_what_it_would_ignore(key, value):
    with pytest.raises(ValueError, match=f"trl_async.*{key}"):
        RecipeConfig(trainer="trl_async", **{key: value})


def test_trl_async_refuses_an_unbounded_max_staleness():
    """TRL's AsyncGRPOTrainer takes an int bound (it sizes its in-flight work by it): null
    ("any age") is refused rather than turned into some bound."""
    with pytest.raises(ValueError, match="max_staleness.*trl_async"):
        RecipeConfig(trainer="trl_async", max_staleness=None)
    # custom: any age
    assert RecipeConfig(partial_rollouts=True, max_staleness=None).max_staleness is None


def test_finite_limits_leave_max_grad_norm_unbounded():
    assert RecipeConfig(max_grad_norm=math.inf).max_grad_norm == math.inf  # clip never binds
    assert RecipeConfig(clip_eps=1.0).clip_eps == 1.0  # lower clip bound 0


@pytest.mark.parametrize("overrides, keys", [
    (dict(partial_rollouts=True, carried_kv="park", prefix_caching=False),
     ("carried_kv", "prefix_caching")),
    (dict(max_num_seqs=10**8), ("max_model_len", "max_num_seqs")),
])
def test_engine_combinations_are_checked_before_any_model_is_built(overrides, keys):
    """Combinations the EngineConfig refuses, refused by RecipeConfig (not by build_engine,
    after the model is loaded), naming the recipe's keys (prefix_caching, not the engine's
    enable_prefix_caching)."""
    with pytest.raises(ValueError, match=f"^{', '.join(keys)}: "):
        RecipeConfig(**overrides)


def test_trl_async_samples_with_the_recipes_filters():
    from types import SimpleNamespace

    from rollout_recipes.algo.trl_async_loop import async_args

    cpu = SimpleNamespace(device=torch.device("cpu"))
    args = async_args(RecipeConfig(trainer="trl_async", top_p=0.5, top_k=5, min_p=0.1,
                                   importance_ratio="full_policy"), cpu)
    assert (args.top_p, args.top_k, args.min_p) == (0.5, 5, 0.1)


def test_trl_async_refuses_a_ratio_on_the_support():
    """AsyncGRPOTrainer's forward takes the whole vocabulary: under truncation "on_support"
    (the default) cannot be had there, and had been the untruncated ratio without a word.
    Without truncation the engine's two logprobs are one and any value is accepted."""
    for filters in (dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1)):
        with pytest.raises(ValueError, match="^importance_ratio: .*trl_async.*full_policy"):
            RecipeConfig(trainer="trl_async", **filters)
        RecipeConfig(trainer="trl_async", importance_ratio="full_policy", **filters)
    RecipeConfig(trainer="trl_async")


def test_trl_minibatches_are_checked_before_any_model_is_built():
    with pytest.raises(ValueError, match="minibatches"):
        RecipeConfig(trainer="trl", prompts_per_step=4, num_generations=4, minibatches=3)


def test_overrides_are_read_as_yaml():
    got = parse_overrides(["--learning_rate", "5e-4", "--beta=0.1", "--wandb", "false",
                           "--run_name", "7", "--kv_cache_tokens", "null"])
    assert got == {"learning_rate": 5e-4, "beta": 0.1, "wandb": False, "run_name": "7",
                   "kv_cache_tokens": None}
    # a string field's text as typed: what YAML reads as a comment or quoting stays
    typed = {"system_prompt": "Think, then give the final number after #### ",
             "run_name": "gsm8k #2", "output_dir": "'quoted' out"}
    assert parse_overrides([x for k, v in typed.items() for x in (f"--{k}", v)]) == typed
    assert parse_overrides(["--run_name=#hash"]) == {"run_name": "#hash"}
    with pytest.raises(ValueError, match="steps"):
        parse_overrides(["--steps"])


# --- pieces ----------------------------------------------------------------------------------

def test_rewards():
    assert exact_reward(" 46", "46") == 1.0 and exact_reward("461", "46") == 0.0
    gold = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert math_reward("48 + 24 = 72. The answer is 72.", gold) == 1.0
    assert math_reward("so #### 72\nand then 5 more", gold) == 1.0
    assert math_reward("I think 71", gold) == 0.0 and math_reward("no idea", gold) == 0.0
    assert math_reward("#### 1,234.0", "#### 1234") == 1.0
    # the answer is the first number after `####`, whatever follows on its line
    assert math_reward("7 x 6 is it\n#### 42 (6 x 7)", "#### 42") == 1.0
    assert math_reward("#### 18 dollars for 3 hours", "#### 18") == 1.0
    assert math_reward("#### 3 hours at 6 dollars", "#### 18") == 0.0
    # a number may begin at its point, in completions and gold answers alike
    assert math_reward("Half a cup: the answer is .5", "#### 0.5") == 1.0
    assert math_reward("The answer is 0.5", "#### .5") == 1.0
    assert math_reward("it fell by -.25", "#### -0.25") == 1.0
    assert math_reward("10-3 = 7", "#### 7") == 1.0 and math_reward("####\n42", "#### 42") == 1.0
    assert math_reward("so the answer is...10", "#### 10") == 1.0  # not .10
    assert math_reward("#### ...10", "#### 10") == 1.0


@pytest.mark.parametrize("flag, env, want", [
    (None, None, "offline"), (None, "disabled", None), (None, "online", "online"),
    ("disabled", "offline", None), ("online", "offline", "online"), ("offline", "online", "offline")])
def test_wandb_mode_flag_wins_over_the_environment(tmp_path, monkeypatch, flag, env, want):
    import wandb

    from rollout_recipes.run.tracking import Tracker

    if env is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env)
    modes = []
    monkeypatch.setattr(wandb, "init", lambda **kw: modes.append(kw["mode"]))
    tracker = Tracker(RecipeConfig(output_dir=str(tmp_path), wandb_mode=flag), is_main=True)
    tracker.finish()
    assert modes == ([want] if want else [])
    assert (tracker.wandb_dir is None) == (want is None)  # what the reports name


def test_data_seed_keeps_the_held_out_set_across_seeds():
    from rollout_recipes.tasks import load_task

    def held_out(**keys):
        return load_task(RecipeConfig(train_size=100, eval_size=50, **keys)).eval["prompt"]

    fixed = held_out(seed=0)
    assert held_out(seed=1, data_seed=0) == held_out(seed=2, data_seed=0) == fixed
    assert held_out(seed=1) != fixed  # unset, it follows the seed


def test_reversal_task_spans_every_answer_length_and_never_trains_on_held_out():
    from rollout_recipes.tasks import load_task
    from rollout_recipes.tasks.reverse import LONGEST

    task = load_task(RecipeConfig(task="reverse", train_size=2000, eval_size=300, data_seed=3))
    train = list(zip(task.train["prompt"], task.train["answer"]))
    held_out = list(zip(task.eval["prompt"], task.eval["answer"]))
    assert len(train) == 2000 and len(held_out) == 300
    assert not {p for p, _ in train} & {p for p, _ in held_out}
    for prompt, answer in train + held_out:
        assert prompt.endswith("=") and prompt[:-1].isdigit() and answer == prompt[-2::-1]
    lengths = {len(a) for _, a in train}
    assert lengths == set(range(1, LONGEST + 1)), lengths
    assert task.reward(f" {held_out[0][1]}", held_out[0][1]) == 1.0
    assert task.reward(held_out[0][1][::-1] + "0", held_out[0][1]) == 0.0


def test_group_advantages_and_gae():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, group)
    assert adv[4:].abs().max() == 0  # equal rewards: no signal
    # zero-mean within the group: the sum of its 4 float32 values cancels but for roundings
    assert adv[:4].sum().abs() <= tolerance(0.0, adv[:4]) and adv[0] > 0 > adv[1]
    # gamma = lam = 1 and zero values: every completion token's advantage is the final reward.
    mask = torch.tensor([[0.0, 1, 1, 1, 0]])
    r = torch.tensor([[0.0, 0, 0, 2, 0]])
    adv, ret = gae(r, torch.zeros_like(r), mask, gamma=1.0, lam=1.0)
    assert adv.tolist() == [[0.0, 2, 2, 2, 0]] and ret.tolist() == adv.tolist()


@pytest.mark.slow
def test_demo_learns(tmp_path):
    from rollout_recipes.demo import main as demo

    out = demo(["--wandb", "false", "--output_dir", str(tmp_path)])
    assert out["accuracy_after"] >= out["accuracy_before"] + 0.15, out


def test_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match="model"):
        main(["--config", write_config(tmp_path), "--model", str(tmp_path / "no-such-model")])


@pytest.mark.parametrize("trainer", ["custom", "trl"])
def test_named_model_and_dataset_files(tmp_path, trainer):
    """The real-model path without a download: a model directory whose tokenizer has a chat
    template, and a JSONL of GSM8K-style rows scored by the math reward. Both trainers: TRL
    takes the prompts as conversations and scores completions as assistant messages."""
    from rollout_recipes.run.tiny import char_tokenizer, tiny_llama

    tok = char_tokenizer("0123456789+=#abcdefghijklmnopqrstuvwxyz ?.\n")
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}={{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}a={% endif %}")
    tiny_llama(tok, seed=0, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    with open(tmp_path / "data.jsonl", "w") as f:
        for a in range(40):
            f.write(json.dumps({"question": f"what is {a}+{a}?", "answer": f"#### {2 * a}"}) + "\n")
    out = main(["--config", write_config(tmp_path), "--model", str(tmp_path / "model"),
                "--dataset", str(tmp_path / "data.jsonl"), "--prompt_template", "{question}",
                "--eval_size", "8", "--system_prompt", "add", "--warmstart_steps", "2",
                "--trainer", trainer])
    check_steps(out["history"])
    assert out["accuracy_before"] is not None
    from rollout.engine.chat import render_conversations
    from rollout_recipes.tasks import load_task

    cfg = RecipeConfig(model=str(tmp_path / "model"), dataset=str(tmp_path / "data.jsonl"),
                       prompt_template="{question}", system_prompt="add", eval_size=8)
    task = load_task(cfg, tok)
    assert task.chat and len(task.train) == 32 and len(task.eval) == 8
    [(text, _)] = render_conversations(tok, [task.train[0]["prompt"]])
    assert text.startswith("s=add\nu=what is ") and text.endswith("?\na=")


# --- review fixes: rewards, defaults, tracking, config files ---------------------------------

def test_exact_match_scores_every_token_the_model_wrote(tmp_path):
    """Exact match scores the tokens after the prompt, not the engine's text (special tokens
    skipped): a stray special token or an answer without EOS (cut at max_tokens) is wrong, on
    every exact-match task; math stays lenient about both by design."""
    from rollout_recipes.run.tiny import char_tokenizer
    from rollout_recipes.tasks import builtin_alphabet, load_task

    for name in ("addition", "reverse", "calculator"):
        cfg = RecipeConfig(task=name, train_size=20, eval_size=5)
        task = load_task(cfg)
        tok = char_tokenizer(builtin_alphabet(cfg))
        eos = frozenset({tok.eos_token_id})
        for answer in task.eval["answer"]:
            lead = "<c>1+1</c><r>2</r>" if name == "calculator" else ""  # an episode's turns
            right = tok.encode(lead + answer) + [tok.eos_token_id]
            variants = [right, right[:-1], tok.encode(lead + answer + "<pad><pad>"),
                        tok.encode(lead + "<bos>" + answer + "<eos>"),
                        tok.encode(lead + answer[:1] + "<pad>" + answer[1:] + "<eos>"),
                        tok.encode(lead + answer + "<pad><eos>"),
                        tok.encode(lead + answer + "0<eos>")]
            # the naive rule: right only when the tokens are the answer's and then EOS
            got = [task.score(tok, ids, answer, eos) for ids in variants]
            assert got == [float(ids == right) for ids in variants], (name, answer, got)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}?", "answer": f"#### {i}"}) + "\n"
                            for i in range(4)))
    math = load_task(RecipeConfig(model=str(tmp_path), dataset=str(data), eval_size=1), None)
    tok = char_tokenizer("0123456789# ")
    # lenient by design: a completion cut after its answer's number still named it
    assert math.score(tok, tok.encode("#### 42 and"), "#### 42", {tok.eos_token_id}) == 1.0


def test_held_out_accuracy_and_trl_rewards_score_the_tokens():
    """The repro's sample: "4", <bos>, "6", <pad>, <pad> with no EOS, whose engine text is "46",
    scores 0 in held-out accuracy and in the TRL trainer's reward function; "46" EOS scores 1."""
    from types import SimpleNamespace

    from rollout import RolloutOutput
    from rollout.requests.outputs import Sample
    from rollout_recipes.algo.trl_loop import correctness_reward
    from rollout_recipes.run.evaluate import held_out_accuracy
    from rollout_recipes.run.tiny import char_tokenizer
    from rollout_recipes.tasks import builtin_alphabet, load_task

    cfg = RecipeConfig(train_size=10, eval_size=2)
    task = load_task(cfg)
    tok = char_tokenizer(builtin_alphabet(cfg))
    answers = list(task.eval["answer"])
    written = [tok.encode(answers[0][:1] + "<bos>" + answers[0][1:] + "<pad><pad>"),
               tok.encode(answers[1]) + [tok.eos_token_id]]
    assert tok.decode(written[0], skip_special_tokens=True) == answers[0]  # what Sample.text is

    class Rollout:  # the ColocatedRollout surface held_out_accuracy uses
        engine = SimpleNamespace(tp=SimpleNamespace(size=1), eos_ids=frozenset({2}))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def generate(self, prompts, params, use_tqdm=False):
            return [RolloutOutput(str(i), p, [Sample(0, ids, None, reason, text=tok.decode(
                ids, skip_special_tokens=True))]) for i, (p, ids, reason) in
                enumerate(zip(prompts, written, ["length", "stop"]))]

    accelerator = SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"),
                                  is_main_process=True, reduce=lambda t, reduction: t)
    assert held_out_accuracy(Rollout(), task, tok, 5, accelerator) == 0.5
    reward = correctness_reward(task, tok, frozenset({tok.eos_token_id}))
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in written]
    assert reward(prompts=list(task.eval["prompt"]), completions=texts, completion_ids=written,
                  answer=answers) == [0.0, 1.0]


def test_a_dataset_without_a_prompt_column_gets_its_question(tmp_path):
    """The documented config-less command, `--model X --dataset Y` on GSM8K's columns
    (question, answer): prompts are the questions; a `prompt` column wins; neither is a
    ValueError naming prompt_template."""
    from rollout_recipes.tasks import load_task

    def rows(path, **columns):
        with open(path, "w") as f:
            for i in range(10):
                f.write(json.dumps({k: v.format(i=i) for k, v in columns.items()}) + "\n")
        return str(path)

    questions = rows(tmp_path / "q.jsonl", question="what is {i}+1?", answer="#### {i}")
    cfg = load_config(None, parse_overrides(["--model", str(tmp_path), "--dataset", questions]))
    task = load_task(cfg, None)
    assert sorted(list(task.train["prompt"]) + list(task.eval["prompt"])) == \
        sorted(f"what is {i}+1?" for i in range(10))
    prompts = rows(tmp_path / "p.jsonl", prompt="p{i}", question="q{i}", answer="#### {i}")
    task = load_task(RecipeConfig(model=str(tmp_path), dataset=prompts), None)
    assert all(p.startswith("p") for p in task.train["prompt"])
    neither = rows(tmp_path / "n.jsonl", text="t{i}", answer="#### {i}")
    with pytest.raises(ValueError, match="prompt_template: unset.*'prompt' or 'question'"):
        load_task(RecipeConfig(model=str(tmp_path), dataset=neither), None)


def test_an_empty_held_out_set_is_refused(tmp_path):
    from rollout_recipes.tasks import load_task

    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    with pytest.raises(ValueError, match="eval_size: .*empty"):
        load_task(RecipeConfig(model=str(tmp_path), dataset=str(path), eval_size=4), None)


@pytest.mark.parametrize("name", ["addition", "reverse", "calculator"])
def test_builtin_max_new_tokens_fits_the_tasks_longest_turn(name):
    """Left unset, max_new_tokens fits every answer and EOS of the built-in task's data (and
    the calculator's longest tool call), counted with the built-in tokenizer."""
    from rollout_recipes.run.tiny import char_tokenizer
    from rollout_recipes.tasks import builtin_alphabet, load_task

    cfg = RecipeConfig(task=name)
    task = load_task(cfg)
    tok = char_tokenizer(builtin_alphabet(cfg))
    rows = [(r["prompt"], r["answer"]) for split in (task.train, task.eval) for r in split]
    need = max(len(tok.encode(a)) + 1 for _, a in rows)
    if name == "calculator":
        need = max(need, max(len(tok.encode(f"<c>{p[:-1]}</c>")) for p, _ in rows))
    assert need <= cfg.max_new_tokens < cfg.max_model_len
    assert RecipeConfig(task=name, model="org/name").max_new_tokens == 256  # a named model's


def test_an_infinite_metric_is_logged_and_plotted(tmp_path):
    """A rollout-vs-trainer gap past exp's range gives prob_error inf (no OverflowError); the
    history keeps it a float, the JSONL a string, and the reward curve is drawn."""
    from rollout_recipes.algo.update_metrics import ratio_metrics
    from rollout_recipes.run.plot import reward_curve
    from rollout_recipes.run.tracking import Tracker

    totals = {"mismatch/tokens": 2.0, "mismatch/gap": 2000.0, "mismatch/gap_max": 1500.0,
              "clip_frac": 0.0, "ratio": 2.0, "ratio_abs_dev": 0.0, "ratio_outside": 0.0,
              "mismatch/ratio_min": 0.5, "mismatch/ratio_max": math.inf, "mismatch/kl": 3.0}
    metrics = ratio_metrics(totals, 2.0)
    assert metrics["mismatch/prob_error"] == math.inf
    tracker = Tracker(RecipeConfig(wandb=False, output_dir=str(tmp_path), progress=False), True)
    tracker.log({"reward/mean": 0.5, **metrics}, step=1)
    tracker.log({"reward/mean": 0.6, **ratio_metrics({**totals, "mismatch/gap": 0.2,
                                                      "mismatch/ratio_max": 1.1}, 2.0)}, step=2)
    tracker.finish()
    assert tracker.history[0]["mismatch/ratio_max"] == math.inf
    assert tracker.history[0]["mismatch/prob_error"] == math.inf
    assert read_jsonl(tracker.jsonl_path)[0]["mismatch/ratio_max"] == "inf"
    path = reward_curve(tracker.history, str(tmp_path / "curve.png"), "t",
                        accuracy={"before": 0.1, "after": 0.2})
    assert os.path.getsize(path) > 0


def test_wandb_mode_from_the_environment_is_checked(tmp_path, monkeypatch):
    """An exported but empty $WANDB_MODE reads as unset: a real offline W&B run starts (wandb
    reads the variable too, and refuses ""), and the process environment is left as the
    caller had it; a bad one is a ValueError naming it before any file is written."""
    from rollout_recipes.run.tracking import Tracker

    monkeypatch.setenv("WANDB_MODE", "")
    before = dict(os.environ)
    tracker = Tracker(RecipeConfig(output_dir=str(tmp_path / "empty")), is_main=True)
    tracker.finish()
    assert tracker.wandb_mode == "offline" and os.listdir(tracker.wandb_dir)
    # wandb's own: the address of its service, exported for child processes by its first init
    after = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE" or k in before}
    assert after == before
    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(ValueError, match="WANDB_MODE.*'bogus'"):
        Tracker(RecipeConfig(output_dir=str(tmp_path / "bad")), is_main=True)
    assert not os.path.exists(tmp_path / "bad" / "metrics.jsonl")  # nothing truncated


def test_a_failing_wandb_init_closes_the_metrics_file(tmp_path, monkeypatch):
    import builtins

    import wandb

    from rollout_recipes.run import tracking

    opened = []

    def recording_open(*args, **kwargs):
        opened.append(builtins.open(*args, **kwargs))
        return opened[-1]

    def init(**kwargs):
        raise RuntimeError("no W&B today")

    monkeypatch.setattr(tracking, "open", recording_open, raising=False)
    monkeypatch.setattr(wandb, "init", init)
    with pytest.raises(RuntimeError, match="no W&B today"):
        tracking.Tracker(RecipeConfig(output_dir=str(tmp_path)), is_main=True)
    assert len(opened) == 1 and opened[0].closed


def test_exponent_floats_without_a_dot_are_floats_at_every_level(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-5\nlora: {r: 8, lora_alpha: 16, lora_dropout: 5e-2}\n"
                    "speculative: {method: ngram, history_min_share: 3E-1}\n")
    cfg = load_config(str(path))
    assert cfg.learning_rate == 1e-5 and cfg.lora["lora_dropout"] == 0.05
    assert cfg.speculative["history_min_share"] == 0.3
    got = parse_overrides(["--lora", "{r: 4, lora_dropout: 1e-1}", "--beta", "2e-2"])
    assert got == {"lora": {"r": 4, "lora_dropout": 0.1}, "beta": 0.02}
    # still what YAML reads otherwise: ints, strings, dotted floats
    assert parse_overrides(["--steps", "12", "--clip_eps", "0.25"]) == {"steps": 12,
                                                                        "clip_eps": 0.25}


def test_non_string_keys_in_a_config_file_are_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("on: 1\nlearning_rat: 1.0e-4\n")  # YAML 1.1 reads `on` as True
    with pytest.raises(ValueError, match=r"config: key\(s\) \[True\] .*quote"):
        load_config(str(path))
    with pytest.raises(ValueError, match=r"lora: unknown key\(s\) \[True\]"):
        RecipeConfig(lora={True: 1})


def test_a_missing_local_dataset_or_an_upper_case_extension(tmp_path):
    from rollout_recipes.tasks import load_task

    for missing in ("./no_such_dir/gsm8k", str(tmp_path / "none"), str(tmp_path / "x.JSONL")):
        with pytest.raises(ValueError, match="dataset: .*not found"):
            RecipeConfig(model=str(tmp_path), dataset=missing, prompt_template="{question}")
    path = tmp_path / "train.JSONL"
    path.write_text("".join(json.dumps({"question": f"{i}?", "answer": f"#### {i}"}) + "\n"
                            for i in range(6)))
    task = load_task(RecipeConfig(model=str(tmp_path), dataset=str(path), eval_size=2), None)
    assert len(task.train) == 4 and len(task.eval) == 2
