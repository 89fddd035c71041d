"""RecipeConfig: one dataclass for every recipe knob, read from YAML then `--key value` overrides.

Every mistake a user can make in a config (an unknown key, a missing file, a value of the wrong
type or out of range) raises ValueError naming the key, before any model is built: a typo in a
launch script should cost seconds, not a model load.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import types
import typing
from dataclasses import dataclass, field

import torch

from rollout.config import CARRIED_KV, LORA_MODES

from . import smollm2
from .data_files import is_data_file
from .options import engine_config, lora_config, speculative_config
from .tiny import char_tokenizer, tiny_llama

TRAINERS = ("custom", "trl", "trl_async")
ALGOS = ("grpo", "ppo")
REWARDS = ("auto", "exact", "math")
TASKS = ("addition", "calculator", "reverse")
WANDB_MODES = ("offline", "online", "disabled")  # wandb_mode's, and $WANDB_MODE's


@dataclass
class RecipeConfig:
    # --- what to train -------------------------------------------------------------------------
    model: str | None = None  # HF id or local path; None: the built-in tiny Llama
    tiny_model: dict = field(default_factory=lambda: dict(hidden_size=128, num_hidden_layers=2))
    dataset: str | None = None  # HF id, local dir or .json/.jsonl/.csv/.parquet; None: built-in
    dataset_config: str | None = None  # e.g. "main" for openai/gsm8k
    # The built-in task (addition | calculator | reverse), when `dataset` is None.
    task: str = "addition"
    train_size: int = 8000  # built-in task sizes (a dataset's own splits are used otherwise)
    # Seed of the built-in task's train/held-out split and of dataset shuffles; None: `seed`.
    # Fixed, it keeps the held-out set (and what a warm start saw) across a sweep of seeds.
    data_seed: int | None = None
    eval_size: int = 200  # held-out prompts scored greedily before and after; 0: skip
    eval_every: int = 0  # also score every this many RL steps (not trl_async); 0: never
    train_split: str = "train"
    eval_split: str = "test"
    # str.format over a dataset row; None: the row's `prompt` column, else its `question`
    # (GSM8K's), so that `--model X --dataset openai/gsm8k` runs without a template.
    prompt_template: str | None = None
    answer_field: str = "answer"
    system_prompt: str | None = None
    chat_template: bool | None = None  # None: use the tokenizer's chat template if it has one
    reward: str = "auto"  # exact | math; auto: exact for the built-in task, math for datasets

    # --- trainer --------------------------------------------------------------------------------
    trainer: str = "custom"  # custom (the loop in recipes/algo/custom_loop.py) | trl
    algo: str = "grpo"  # grpo | ppo (custom trainer only)
    steps: int = 100
    prompts_per_step: int = 32  # per engine; each engine rolls out its own shard
    num_generations: int = 8  # samples per prompt (the GRPO group)
    temperature: float = 1.0
    # Truncated sampling: the engine's behaviour logprobs are then the truncated distribution's
    # (Sample.sampling_logprobs), and `importance_ratio` says what the trainer's side is:
    # "on_support" its logprobs renormalised over the tokens the sampler kept
    # (rollout.logprobs_on_support: a ratio of 1 on-policy), "full_policy" its untruncated
    # logprobs (a ratio of pi / mu, below 1 by the mass the filters cut). Multi-turn episodes
    # take "full_policy" (their environment turns carry no support).
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    importance_ratio: str = "on_support"
    max_new_tokens: int | None = None  # None: auto (see _AUTO below)
    learning_rate: float | None = None
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    epochs: int = 1  # optimisation passes over each rollout batch
    minibatches: int = 1  # optimizer steps per pass (the batch split in as many parts)
    micro_batch_size: int | None = None  # sequences per forward/backward (grad accumulation)
    clip_eps: float = 0.2  # the ratio's clip range [1 - clip_eps, 1 + clip_eps]: at most 1
    beta: float = 0.0  # KL to a frozen reference (GRPO loss term, PPO reward penalty)
    gamma: float = 1.0  # PPO: discount
    lam: float = 0.95  # PPO: GAE lambda
    vf_coef: float = 0.5  # PPO: value loss weight
    value_clip: float = 0.2  # PPO: clip of the value update
    gradient_checkpointing: bool = False
    # MoE policies (single-turn): force the experts the rollout chose in the training forwards
    # (recipes/algo/routing_replay.py). moe/routing_flip_rate is logged either way.
    routing_replay: bool = False
    # Trained weights' dtype; keep float32 and let `accelerate launch --mixed_precision bf16`
    # autocast, since AdamW on bf16 weights loses small updates.
    model_dtype: str = "float32"

    # --- partial rollouts (custom trainer, single-turn: docs/partial-rollouts.md) ------------
    # Each step trains on the first prompts_per_step groups to complete; over_sample x that
    # many are in flight, the others carried into the next step under the new weights, at most
    # max_staleness versions old (older ones restart from their prompts; null: any age, not
    # for trl_async, whose bound is TRL's int). The loss is then decoupled: clipped against the
    # policy at the start of the step, each token weighted by that policy over the one that
    # sampled it, capped at behaviour_weight_cap.
    partial_rollouts: bool = False
    over_sample: float = 1.0
    max_staleness: int | None = 1
    # What a carried sample resumes from (EngineConfig.carried_kv): "recompute" re-prefills it
    # under the new weights, "park" goes on from its K/V (the behaviour logprobs are then the
    # ones sampled from that K/V, which is what the decoupled loss weighs by).
    carried_kv: str = "recompute"
    behaviour_weight_cap: float = 2.0
    # DAPO's dynamic sampling: groups whose rewards are all equal (no GRPO signal) are dropped
    # and more prompts drawn, up to dynamic_sampling_draws rollout calls a step.
    dynamic_sampling: bool = False
    dynamic_sampling_draws: int = 4

    # --- multi-turn episodes (tasks with an environment: calculator) ---------------------------
    tools: bool = True  # roll out episodes with the task's environment; false: single-turn
    max_turns: int = 4  # model turns per episode
    max_episode_tokens: int | None = None  # model + env tokens after the prompt; None: model len
    env_timeout: float | None = None  # seconds an environment step may take; None: no limit
    # (`max_new_tokens` bounds each model turn)

    # --- supervised warm start (so rewards are not all zero on a fresh model) ------------------
    warmstart_steps: int | None = None
    warmstart_lr: float = 1e-3
    warmstart_batch_size: int = 64
    warmstart_examples: int | None = None  # train only on the first this many rows; None: all

    # --- engine -----------------------------------------------------------------------------
    kv_cache_tokens: int | None = None  # None: a share of free device memory
    max_model_len: int | None = None
    max_num_seqs: int = 512
    dtype: str | None = None  # the engine's dtype (e.g. bfloat16); None: the model's
    kv_memory_fraction: float = 0.3  # share of free device memory when kv_cache_tokens is None
    sleep_level: int = 1  # 1: weights parked on host while asleep; 2: dropped
    prefix_caching: bool = True
    cuda_graphs: bool = False  # replay decode steps from CUDA graphs (GPU, Triton backend)
    # rollout.spec.SpeculativeConfig keys, e.g. {method: ngram, num_speculative_tokens: 4}
    speculative: dict | None = None
    # Train a LoRA adapter instead of every weight: peft.LoraConfig keys, e.g. {r: 16,
    # lora_alpha: 32, target_modules: all-linear}. The engine serves it unmerged (base loaded
    # once, each sync copies the adapter: rollout/lora/) or as `lora_mode` says.
    lora: dict | None = None
    lora_mode: str = "auto"  # EngineConfig.lora: auto | unmerged | merged
    # Ranks per engine: `accelerate launch --num_processes W` runs W / k engines of k ranks,
    # each holding 1/k of the model (rollout/parallel/); prompts are sharded across the
    # engines. Must divide W (checked at launch, when W is known).
    tensor_parallel_size: int = 1

    # --- run --------------------------------------------------------------------------------
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads; None: torch's default
    output_dir: str = "outputs/grpo"  # outputs/ is git-ignored
    run_name: str | None = None
    wandb: bool = True
    wandb_project: str = "rollout-recipes"
    # None: $WANDB_MODE, else offline (no network needed; `wandb sync` later); a mode given
    # here wins over $WANDB_MODE
    wandb_mode: str | None = None
    plot: bool = True
    progress: bool = True  # tqdm bars and per-step lines

    def __post_init__(self) -> None:
        _expand_home(self)
        for name, (builtin, named) in _AUTO.items():
            if getattr(self, name) is None:
                value = builtin if self.model is None else named
                setattr(self, name, value(self) if callable(value) else value)
        _check_types(self)
        _check_values(self)

    @property
    def truncates(self) -> bool:
        """The sampler keeps fewer tokens than the vocabulary (top-p, top-k or min-p)."""
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0

    @property
    def split_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def reward_kind(self) -> str:
        if self.reward != "auto":
            return self.reward
        return "exact" if self.dataset is None else "math"


def _longest_turn(cfg: RecipeConfig) -> int | None:
    """The built-in task's longest model turn in tokens (its `longest_turn`): every answer (or
    tool call) fits, and the exact-match reward gives nothing longer any credit."""
    from ..tasks import BUILTIN  # here: the tasks import this module

    task = BUILTIN.get(cfg.task) if isinstance(cfg.task, str) else None
    return task.longest_turn(cfg) if task else None  # an unknown task: _check_values names it


# Keys left None get a value that fits the model: (built-in tiny model, a named model), or a
# function of the config. A named model without a config then still runs (`--model X
# --dataset Y`); its YAML tunes the rest.
_AUTO = {"max_new_tokens": (_longest_turn, 256), "max_model_len": (64, 1024),
         "learning_rate": (1e-4, 1e-6), "micro_batch_size": (64, 8), "warmstart_steps": (300, 0)}

_POSITIVE = ("steps", "prompts_per_step", "num_generations", "max_new_tokens", "epochs",
             "minibatches", "micro_batch_size", "warmstart_batch_size", "max_model_len",
             "max_num_seqs", "train_size", "max_turns", "tensor_parallel_size",
             "dynamic_sampling_draws")
_NON_NEGATIVE = ("eval_size", "eval_every", "warmstart_steps", "max_grad_norm", "seed")
# Weights in the loss and the update: an infinite one makes the first loss or step NaN (inf x 0).
# (max_grad_norm may be inf: a clip that never binds.)
_NON_NEGATIVE_FINITE = ("beta", "weight_decay", "vf_coef")


def _check_values(cfg: RecipeConfig) -> None:
    for name, allowed in (("trainer", TRAINERS), ("algo", ALGOS), ("reward", REWARDS),
                          ("task", TASKS), ("wandb_mode", (None, *WANDB_MODES)),
                          ("importance_ratio", ("on_support", "full_policy")),
                          ("lora_mode", LORA_MODES)):
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {getattr(cfg, name)!r}")
    for name in _POSITIVE:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in _NON_NEGATIVE:
        if not getattr(cfg, name) >= 0:  # `not >=`: NaN fails too
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    for name in _NON_NEGATIVE_FINITE:
        if not 0 <= getattr(cfg, name) < math.inf:
            raise ValueError(f"{name} must be >= 0 and finite, got {getattr(cfg, name)}")
    if not cfg.seed < 2**32:  # accelerate's set_seed seeds numpy, which takes 32 bits
        raise ValueError(f"seed must be < 2**32, got {cfg.seed}")
    if cfg.data_seed is not None and not 0 <= cfg.data_seed < 2**32:
        raise ValueError(f"data_seed must be in [0, 2**32) or null (seed), got {cfg.data_seed}")
    if cfg.num_threads is not None and cfg.num_threads < 1:
        raise ValueError(f"num_threads must be >= 1 or null (torch's default), "
                         f"got {cfg.num_threads}")
    for name in ("dtype", "model_dtype"):
        value = getattr(cfg, name)
        dtype = getattr(torch, value, None) if value is not None else None
        if value is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"{name} must name a floating-point torch dtype (e.g. bfloat16), "
                             f"got {value!r}")
    if not 0 < cfg.kv_memory_fraction <= 1:
        raise ValueError(f"kv_memory_fraction must be in (0, 1], got {cfg.kv_memory_fraction}")
    for name in ("learning_rate", "warmstart_lr", "temperature", "value_clip"):
        if not 0 < getattr(cfg, name) < math.inf:
            raise ValueError(f"{name} must be > 0 and finite, got {getattr(cfg, name)}")
    if not 0 < cfg.clip_eps <= 1:  # above 1 the ratio's lower clip bound 1 - clip_eps is < 0
        raise ValueError(f"clip_eps must be in (0, 1] (the ratio is clipped to [1 - clip_eps, "
                         f"1 + clip_eps]), got {cfg.clip_eps}")
    if not 0 < cfg.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {cfg.top_p}")
    if not 0 <= cfg.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {cfg.min_p}")
    if cfg.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {cfg.top_k}")
    batch = cfg.prompts_per_step * cfg.num_generations
    if cfg.minibatches > batch:
        raise ValueError(f"minibatches must be <= prompts_per_step x num_generations = {batch} "
                         f"(one sample per minibatch at least), got {cfg.minibatches}")
    if cfg.trainer == "trl" and batch % cfg.minibatches:
        raise ValueError(f"minibatches: {cfg.minibatches} must divide prompts_per_step x "
                         f"num_generations = {batch} for the trl trainer")
    if cfg.trainer == "trl_async" and cfg.max_staleness is None:
        # AsyncGRPOTrainer takes an int bound: it drops samples past it and sizes the work it
        # keeps in flight by it. "Any age" has no such int; some bound would be a silent change.
        raise ValueError("max_staleness: trainer trl_async (TRL's AsyncGRPOTrainer) needs a "
                         "bound, an int >= 0 (TRL's default is 4), got null (any age)")
    if cfg.trainer == "trl_async":
        # AsyncGRPOConfig has no KL term, one optimizer step per batch and a policy loaded from
        # a full checkpoint (a PEFT model saves its adapter alone): refused, not ignored.
        unmet = [f"{name} {getattr(cfg, name)}" for name, default in
                 (("beta", 0.0), ("minibatches", 1), ("epochs", 1), ("lora", None))
                 if getattr(cfg, name) != default]
        if unmet:
            raise ValueError(f"trainer: trl_async (TRL's AsyncGRPOTrainer) trains without a KL "
                             f"term, one optimizer step per batch and no LoRA; got "
                             f"{', '.join(unmet)} (set --beta 0 --minibatches 1 --epochs 1 and "
                             f"no lora, or use --trainer trl or custom)")
    if cfg.trainer == "trl_async" and cfg.truncates and cfg.importance_ratio == "on_support":
        # AsyncGRPOTrainer's forward takes the whole vocabulary: no renormalised side to
        # divide by the sampling logprobs. (Untruncated, the engine's two logprobs are one.)
        raise ValueError("importance_ratio: on_support needs the trainer's logprobs "
                         "renormalised over the sampler's kept tokens, which trainer trl_async "
                         "(TRL's AsyncGRPOTrainer) cannot give under top_p / top_k / min_p; set "
                         "--importance_ratio full_policy or use --trainer trl or custom")
    for name in ("gamma", "lam"):
        if not 0 <= getattr(cfg, name) <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {getattr(cfg, name)}")
    if cfg.sleep_level not in (1, 2):
        raise ValueError(f"sleep_level must be 1 or 2, got {cfg.sleep_level}")
    if cfg.kv_cache_tokens is not None and cfg.kv_cache_tokens < cfg.max_model_len:
        raise ValueError(f"kv_cache_tokens must be >= max_model_len ({cfg.max_model_len}), "
                         f"got {cfg.kv_cache_tokens}")
    if cfg.algo == "grpo" and cfg.num_generations < 2:
        raise ValueError("num_generations must be >= 2 for grpo: advantages are normalised "
                         "within each prompt's group")
    for name in ("max_episode_tokens", "warmstart_examples"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1 or null, got {getattr(cfg, name)}")
    if cfg.env_timeout is not None and not cfg.env_timeout > 0:
        raise ValueError(f"env_timeout must be > 0 seconds or null, got {cfg.env_timeout}")
    if cfg.trainer == "trl_async" and (_has_environment(cfg) or cfg.algo != "grpo"
                                       or cfg.tensor_parallel_size > 1):
        raise ValueError("trainer: trl_async (TRL's AsyncGRPOTrainer) runs grpo on single turns "
                         "on one engine of one rank (--algo grpo, --tools false, "
                         "--tensor_parallel_size 1)")
    if cfg.trainer == "trl" and _has_environment(cfg):
        raise ValueError("trainer: the calculator task's episodes run in the custom trainer "
                         "(--trainer custom); TRL's own tool loop is trainer_hooks.trl's tools=")
    if cfg.tensor_parallel_size > 1 and _has_environment(cfg):
        # rollout.agent's environments answer in a different order on each rank, so the ranks
        # of one engine would admit different observations (docs/tensor-parallel.md).
        raise ValueError("tensor_parallel_size: the calculator task's episodes run on engines "
                         "of one rank only; set --tools false or tensor_parallel_size 1")
    if not 1 <= cfg.over_sample < math.inf:
        raise ValueError(f"over_sample must be >= 1 and finite (groups in flight per group "
                         f"trained), got {cfg.over_sample}")
    if not 1 <= cfg.behaviour_weight_cap < math.inf:
        raise ValueError(f"behaviour_weight_cap must be >= 1 and finite, "
                         f"got {cfg.behaviour_weight_cap}")
    if cfg.max_staleness is not None and cfg.max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 or null (any age), got {cfg.max_staleness}")
    if cfg.carried_kv not in CARRIED_KV:
        raise ValueError(f"carried_kv must be one of {', '.join(CARRIED_KV)}, "
                         f"got {cfg.carried_kv!r}")
    # They shape the groups partial rollouts keep in flight, what those resume from and how
    # stale tokens are weighed (max_staleness also bounds trl_async's); set without partial
    # rollouts they would be ignored without a word.
    partial_keys = ("over_sample", "carried_kv", "behaviour_weight_cap") + \
        (("max_staleness",) if cfg.trainer != "trl_async" else ())
    unused = [name for name in partial_keys if getattr(cfg, name) != _DEFAULTS[name]]
    if unused and not cfg.partial_rollouts:
        raise ValueError(f"{', '.join(unused)}: take effect with partial rollouts only; set "
                         f"--partial_rollouts true or leave them at their defaults")
    if cfg.dynamic_sampling_draws != _DEFAULTS["dynamic_sampling_draws"] and \
            not cfg.dynamic_sampling:
        raise ValueError("dynamic_sampling_draws: takes effect with dynamic sampling only; set "
                         "--dynamic_sampling true or leave it at its default")
    if cfg.wandb_mode is not None and not cfg.wandb:  # how a W&B run logs: there is none
        raise ValueError(f"wandb_mode: takes effect with a W&B run only, got "
                         f"{cfg.wandb_mode!r} with wandb false; set --wandb true or leave "
                         f"wandb_mode unset")
    for name in ("partial_rollouts", "dynamic_sampling"):
        if getattr(cfg, name) and (cfg.trainer != "custom" or _has_environment(cfg)):
            raise ValueError(f"{name}: the custom trainer's single-turn rollouts only "
                             f"(--trainer custom, and --tools false for the calculator task)")
    if cfg.dynamic_sampling and cfg.algo != "grpo":
        raise ValueError("dynamic_sampling: groups without reward spread carry no GRPO signal; "
                         "it is for algo grpo")
    _check_custom_loop_only(cfg)
    if cfg.trainer == "trl" and cfg.algo != "grpo":
        raise ValueError(f"algo: the trl trainer runs grpo only, got {cfg.algo!r}")
    if cfg.model is None and cfg.dataset is not None:
        raise ValueError("model: the built-in tiny model only knows the built-in task's "
                         "characters; name a model (--model) to train on a dataset")
    if cfg.speculative is not None:
        speculative_config(cfg)  # raises ValueError naming the bad speculative.* key
    if cfg.lora is not None:
        lora_config(cfg)  # likewise for lora.*
    elif cfg.lora_mode != _DEFAULTS["lora_mode"]:  # how a PEFT policy is served: none here
        raise ValueError(f"lora_mode: takes effect with a lora adapter only, got "
                         f"{cfg.lora_mode!r}; set --lora or leave lora_mode at auto")
    _check_tiny_model(cfg.tiny_model)
    positions = {**_TINY_DEFAULTS, **cfg.tiny_model}["max_position_embeddings"]
    if cfg.model is None and cfg.max_model_len > positions:
        # (the engine would refuse it after the model is built, naming RoPE scaling)
        raise ValueError(f"max_model_len: {cfg.max_model_len} is more than the built-in tiny "
                         f"model's context, tiny_model.max_position_embeddings = {positions}; "
                         f"lower max_model_len or raise that")
    if cfg.max_new_tokens >= cfg.max_model_len:
        raise ValueError(f"max_new_tokens must be < max_model_len ({cfg.max_model_len}): a "
                         f"prompt and its completion share it, got {cfg.max_new_tokens}")
    if cfg.dataset is None:
        _check_builtin_task(cfg)
    if cfg.cuda_graphs and not torch.cuda.is_available():
        # The engine replays CUDA graphs with its Triton backend, which it picks on CUDA only:
        # without a device build_engine refused the flag, after the model was built.
        raise ValueError("cuda_graphs: needs a CUDA device (the engine's Triton backend); none "
                         "is visible: set --cuda_graphs false")
    _check_output_dir(cfg.output_dir)
    # What the engine refuses together (carried_kv park without prefix_caching, max_num_seqs x
    # max_model_len past int32), refused now rather than by build_engine after the model loads.
    engine_config(cfg)
    if cfg.model == smollm2.NAME and smollm2.missing():  # the packaged real model
        raise ValueError(f"model: {smollm2.missing()}")
    if cfg.model not in (None, smollm2.NAME):
        _check_checkpoint_name("model", cfg.model)
    draft = (cfg.speculative or {}).get("draft_model")
    if isinstance(draft, str):  # a checkpoint too, loaded when the engine is built
        _check_checkpoint_name("speculative.draft_model", draft)
    if cfg.dataset is not None and is_data_file(cfg.dataset) and not os.path.isfile(cfg.dataset):
        raise ValueError(f"dataset: file not found: {cfg.dataset!r}")
    if cfg.dataset is not None and _looks_like_local_path(cfg.dataset) and \
            not os.path.exists(cfg.dataset):
        raise ValueError(f"dataset: local directory not found: {cfg.dataset!r} (a hub id is "
                         f"'org/name')")
    if cfg.prompt_template is not None and ("{" not in cfg.prompt_template
                                            or "}" not in cfg.prompt_template):
        raise ValueError(f"prompt_template must name a dataset field in braces, e.g. "
                         f"'{{question}}', got {cfg.prompt_template!r}")


def _check_tiny_model(sizes: dict) -> None:
    unknown = set(sizes) - set(_TINY_KEYS)
    if unknown:
        raise ValueError(f"tiny_model: unknown key(s) {sorted(unknown)}; known: {_TINY_KEYS}")
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"tiny_model.{key} must be an int >= 1, got {value!r}")
    # Sizes transformers refuses together, in the first forward or when it builds the model;
    # with the built-in ones for the keys left out.
    sizes = {**_TINY_DEFAULTS, **sizes}
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if heads % kv_heads:  # grouped-query attention: each K/V head serves as many query heads
        raise ValueError(f"tiny_model.num_key_value_heads must divide num_attention_heads "
                         f"({heads}), got {kv_heads}")
    if sizes["hidden_size"] % (2 * heads):  # an even head dimension: RoPE rotates pairs
        raise ValueError(f"tiny_model.hidden_size must be a multiple of 2 x num_attention_heads "
                         f"= {2 * heads} (each head's dimension, hidden_size / "
                         f"num_attention_heads, even for the rotary embedding), "
                         f"got {sizes['hidden_size']}")


def _check_builtin_task(cfg: RecipeConfig) -> None:
    """The built-in task's sizes and, under the built-in tokenizer, its longest prompt against
    max_model_len: known before anything loads, where the task refused them once the output dir
    and the W&B run existed (a named model's tokens are checked when the task loads:
    tasks.load_task)."""
    from ..tasks import BUILTIN  # here: the tasks import this module
    from ..tasks.base import check_prompt_fits, check_rows

    task = BUILTIN[cfg.task]
    check_rows(cfg.task, cfg.train_size, cfg.eval_size, task.MOST_ROWS)
    if cfg.model is None:
        prompt = task.longest_prompt(cfg)
        tokens = len(char_tokenizer(task.ALPHABET).encode(prompt))
        check_prompt_fits(prompt, tokens, cfg.max_new_tokens, cfg.max_model_len)


def _check_custom_loop_only(cfg: RecipeConfig) -> None:
    """Keys only the custom loop acts on, refused where they would change nothing."""
    if cfg.eval_every and cfg.trainer == "trl_async":
        # Its worker thread owns the engine while TRL trains: no scoring between its steps.
        raise ValueError(f"eval_every: trainer trl_async scores the held-out set before and "
                         f"after RL only, got {cfg.eval_every} (set --eval_every 0 or use "
                         f"--trainer custom or trl)")
    # The custom loop records experts for single-turn rollouts of an MoE policy (an Episode
    # keeps no routes; the built-in tiny Llama is dense; a named model is checked once loaded:
    # build.load_model).
    if cfg.routing_replay and (cfg.trainer != "custom" or _has_environment(cfg)
                               or cfg.model is None):
        raise ValueError("routing_replay: replays the experts of an MoE model's single-turn "
                         "rollouts in the custom trainer (--trainer custom, --tools false for "
                         "the calculator task, --model naming an MoE model)")


def _check_output_dir(path: str) -> None:
    """The tracker creates output_dir, parents included, before the model loads: it must be
    a name, and no part of it that exists may be a file."""
    if not path:
        raise ValueError("output_dir must name a directory, got ''")
    existing = path
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing and not os.path.isdir(existing):
        raise ValueError(f"output_dir: {existing!r} is a file, not a directory "
                         f"(output_dir {path!r})")


# Keys that name local paths: `~` is the user's home in them, as in a shell (YAML files and
# `--key=~/x` reach the config unexpanded).
_PATH_KEYS = ("model", "dataset", "output_dir")


def _expand_home(cfg: RecipeConfig) -> None:
    for name in _PATH_KEYS:
        value = getattr(cfg, name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(cfg, name, os.path.expanduser(value))


def _has_environment(cfg: RecipeConfig) -> bool:
    return cfg.task == "calculator" and cfg.dataset is None and cfg.tools


def forward_split(sequences: int, micro_batch_size: int | None) -> tuple[int, int]:
    """(sequences a forward, forwards an optimizer step) for an optimizer step of `sequences`:
    TRL's per-device batches are all of one size, so the largest that divides them and holds
    at most micro_batch_size (None: all of them), the rest by gradient accumulation."""
    most = min(micro_batch_size or sequences, sequences)
    micro = max(d for d in range(1, most + 1) if sequences % d == 0)
    return micro, sequences // micro


def check_world(cfg: RecipeConfig, processes: int) -> None:
    """The checks that need the number of processes, known once the launcher started them."""
    if processes % cfg.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size: {cfg.tensor_parallel_size} must divide the "
                         f"number of processes, {processes}")
    if cfg.trainer == "trl_async" and processes > 1:
        raise ValueError(f"trainer: trl_async runs one engine in one process, got {processes}")


_TINY_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "max_position_embeddings")
# The sizes of the built-in model that a `tiny_model` dict leaves out: tiny_llama's defaults.
_TINY_DEFAULTS = {name: parameter.default
                  for name, parameter in inspect.signature(tiny_llama).parameters.items()
                  if name in _TINY_KEYS}


def _check_checkpoint_name(key: str, name: str) -> None:
    if not _looks_like_hub_id(name) and not os.path.exists(os.path.expanduser(name)):
        raise ValueError(f"{key}: {name!r} is neither an existing path nor a hub id")


def _looks_like_hub_id(name: str) -> bool:
    # "org/name" with no leading dot or slash; local paths start with ./, / or ~ or exist.
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _looks_like_local_path(name: str) -> bool:
    # What can only be a local path: no hub id (a dataset's may be one bare name, "gsm8k").
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def _check_types(cfg: RecipeConfig) -> None:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        allowed = _allowed_types(_HINTS[f.name])
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # YAML writes 1 for 1.0
            setattr(cfg, f.name, value)
        if not any(_is(value, t) for t in allowed):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{f.name} must be {names}, got {value!r}")


def _allowed_types(hint) -> tuple:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _is(value, t) -> bool:
    if t is type(None):
        return value is None
    if t in (int, float) and isinstance(value, bool):
        return False  # True is an int to Python, never to a config
    return isinstance(value, t)


_HINTS = typing.get_type_hints(RecipeConfig)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RecipeConfig)}


def field_types(name: str) -> tuple:
    """The types a RecipeConfig field takes (object for an unknown name)."""
    return _allowed_types(_HINTS.get(name, object))


def to_dict(cfg: RecipeConfig) -> dict:
    return dataclasses.asdict(cfg)
