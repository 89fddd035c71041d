"""TRL (1.16) GRPOTrainer integration: every rollout comes from the engine in the trainer's process.

    trainer = RolloutGRPOTrainer(model, reward_funcs=..., args=GRPOConfig(...),
                                 train_dataset=..., processing_class=tok,
                                 engine_config=EngineConfig(kv_cache_tokens=65536,
                                                            max_model_len=2048))

or, with a plain GRPOTrainer, `rollout_func=make_rollout_func(engine)` (TRL then keeps the
engine's logprobs as `sampling_per_token_logps` but applies no importance-sampling correction:
that is gated on `use_vllm`, which RolloutGRPOTrainer turns on; see there).

How prompts arrive (read from grpo_trainer.py, not its docstring, which says "no duplication"):
the train sampler (RepeatSampler, `mini_repeat_count=num_generations`; eval: `num_generations_eval`)
repeats each prompt, accelerate gives every rank a contiguous slice of that stream, and
`_generate_and_score_completions` scores the i-th completion against the i-th input row. So the
rollout_func must return exactly one completion per entry of `prompts`, in order. We merge equal
prompts into one request with n = their count: the engine computes the shared prompt once.

Each rank runs its own engine on its own device; rollout_func calls no collective (a ZeRO-3
gather of the weights aside, which every rank enters at the same point, before generating).
FSDP-sharded models are not supported yet (their parameters would need full_tensor()).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

import trl.trainer.grpo_trainer as _grpo_module
from torch import nn
from trl import GRPOTrainer
from trl.data_utils import is_conversational
from trl.models import unwrap_model_for_generation

from rollout import Engine, EngineConfig, SamplingParams

from .colocate import ColocatedRollout

EngineFactory = Callable[["GRPOTrainer"], Engine]


def make_rollout_func(engine_or_factory: Engine | EngineFactory, sleep_level: int = 1,
                      seed: int | None = None) -> EngineRollout:
    """A `rollout_func(prompts, trainer)` for GRPOTrainer. `engine_or_factory`: an Engine, or a
    callable building one from the trainer at the first rollout (on its device, after
    `accelerator.prepare`). `seed`: makes sampling reproducible (mixed with rank and call)."""
    return EngineRollout(engine_or_factory, sleep_level, seed)


def build_engine(trainer: GRPOTrainer, config: EngineConfig | None = None) -> Engine:
    """An engine on this rank's device, built from the trainer's (possibly PEFT) model."""
    config = dataclasses.replace(config or EngineConfig(), device=trainer.accelerator.device)
    return Engine(trainer.model, config, tokenizer=getattr(trainer, "_tokenizer", None))


class EngineRollout:
    """The rollout_func object; `engine`, `colocated` and `last_metrics` are for inspection."""

    def __init__(self, engine_or_factory: Engine | EngineFactory, sleep_level: int = 1,
                 seed: int | None = None) -> None:
        if isinstance(engine_or_factory, Engine):
            self.engine, self._factory = engine_or_factory, None
        elif callable(engine_or_factory):
            self.engine, self._factory = None, engine_or_factory
        else:
            raise ValueError("engine_or_factory must be an Engine or a callable(trainer) -> Engine")
        self.sleep_level, self.seed = sleep_level, seed
        self.colocated: ColocatedRollout | None = None
        self.calls = 0
        # (mode, global step) of the last rollout and how many came before it at that key: the
        # seeds' counter, restored with the trainer state when a run resumes from a checkpoint.
        self._at: tuple[int, int] | None = None
        self._index = 0
        self.last_metrics: dict[str, float] = {}

    def setup(self, trainer: GRPOTrainer, synced: bool | None = None) -> Engine:
        """Build the engine (if given a factory) and its colocation wrapper; idempotent.
        `synced`: whether the engine holds the model's weights as they will be at the first
        rollout; by default True only for an engine built right now, at the first rollout. A
        given engine, or one built before `accelerator.prepare` (DDP broadcasts rank 0's
        weights, which need not bump version counters), gets one unconditional sync."""
        if self.colocated is None:
            built_now = self.engine is None
            if built_now:
                self.engine = self._factory(trainer)
            self.colocated = ColocatedRollout(self.engine, trainer.model_wrapped, self.sleep_level,
                                              synced=built_now if synced is None else synced)
        return self.engine

    def __call__(self, prompts: list, trainer: GRPOTrainer) -> dict[str, list]:
        engine = self.setup(trainer)
        rollout = self.colocated
        rollout.model = trainer.model_wrapped  # DDP/DeepSpeed wrap it after __init__
        rollout.gather = lambda m: _gathered(trainer, m)
        prompt_ids = tokenize_prompts(prompts, trainer)
        params = sampling_params(trainer, engine)
        at = (int(not trainer.model.training), trainer.state.global_step)
        self._index = self._index + 1 if at == self._at else 0
        self._at = at
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, ids in enumerate(prompt_ids):
            groups.setdefault(tuple(ids), []).append(i)
        requests = [dataclasses.replace(params, n=len(rows), seed=self._seed(trainer, g))
                    for g, rows in enumerate(groups.values())]
        before = dataclasses.replace(engine.stats)  # a snapshot: stats accumulate in place
        with rollout:
            t0 = time.perf_counter()
            outs = rollout.generate([list(k) for k in groups], requests)
            generate_seconds = time.perf_counter() - t0
        completion_ids: list = [None] * len(prompt_ids)
        logprobs: list = [None] * len(prompt_ids)
        for rows, out in zip(groups.values(), outs):
            for row, sample in zip(rows, out.samples):
                completion_ids[row], logprobs[row] = list(sample.token_ids), list(sample.logprobs)
        self.calls += 1
        self._record(trainer, rollout, before, engine.stats, generate_seconds)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    def _seed(self, trainer: GRPOTrainer, group: int) -> int | None:
        if self.seed is None:
            return None  # the engine draws one per request
        # Keyed by the trainer's step, not by a count of calls, so a run resumed from a
        # checkpoint samples what the uninterrupted run sampled (and evaluations in between
        # leave training's samples alone). Ints only: hash() of str varies per process.
        rank = trainer.accelerator.process_index
        return hash((self.seed, rank, *self._at, self._index, group)) & ((1 << 63) - 1)

    def _record(self, trainer, rollout, before, after, generate_seconds: float) -> None:
        prompt = after.prompt_tokens - before.prompt_tokens
        generated = after.generated_tokens - before.generated_tokens
        m = {
            "rollout/tokens_per_second": generated / generate_seconds if generate_seconds else 0.0,
            "rollout/prefix_cache_hit_rate":
                (after.cache_hit_tokens - before.cache_hit_tokens) / prompt if prompt else 0.0,
            "rollout/generate_seconds": generate_seconds,
            "rollout/wake_seconds": rollout.timings["wake"],
            "rollout/sync_seconds": rollout.timings["sync"],
            "rollout/sleep_seconds": rollout.timings["sleep"],
            "rollout/weight_syncs": float(rollout.synced),
        }
        self.last_metrics = m
        # TRL's own per-step metric store: averaged and logged by GRPOTrainer.log(). Values are
        # this rank's (gathering them would make ranks wait on each other's generation).
        metrics = getattr(trainer, "_metrics", None)
        if metrics is not None:
            mode = "train" if trainer.model.training else "eval"
            for key, value in m.items():
                metrics[mode][key].append(value)


def _gathered(trainer: GRPOTrainer, model):
    """Full weights under ZeRO-3 (via TRL's own helper); a plain unwrap otherwise."""
    return unwrap_model_for_generation(
        model, trainer.accelerator,
        gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
        gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs)


def tokenize_prompts(prompts: list, trainer: GRPOTrainer) -> list[list[int]]:
    """The same ids TRL's own generation path would feed its backend."""
    tok = trainer.processing_class
    if is_conversational({"prompt": prompts[0]}):
        out = tok.apply_chat_template(
            conversation=prompts, add_generation_prompt=True, tokenize=True, return_dict=True,
            chat_template=getattr(trainer, "chat_template", None),
            **(getattr(trainer, "chat_template_kwargs", None) or {}))
        return [list(ids) for ids in out["input_ids"]]
    return [list(ids) for ids in tok(text=prompts)["input_ids"]]


def sampling_params(trainer: GRPOTrainer, engine: Engine) -> SamplingParams:
    """GRPOConfig's generation settings as engine SamplingParams (n is set per prompt group)."""
    args = trainer.args
    if getattr(args, "repetition_penalty", 1.0) != 1.0:
        raise ValueError(f"repetition_penalty: the engine has none; got {args.repetition_penalty}, "
                         f"set it to 1.0")
    if args.generation_kwargs:
        raise ValueError(f"generation_kwargs: not supported by the engine; got "
                         f"{sorted(args.generation_kwargs)}")
    max_tokens = args.max_completion_length or engine.config.max_model_len
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or 0,
        min_p=args.min_p or 0.0, max_tokens=max_tokens,
        stop_token_ids=[t for t in trainer.eos_token_ids if t is not None], logprobs=True)


class _NoVLLM:
    """Stands in for TRL's vLLM backend once `use_vllm` is switched on (see RolloutGRPOTrainer).
    On the rollout_func path TRL calls only `sync_weights()` before each rollout; the
    rollout_func syncs itself (only when the weights changed), so that is a no-op."""

    def sync_weights(self) -> None:
        pass

    def __getattr__(self, name: str):
        raise NotImplementedError(f"vllm_generation.{name}: this TRL path (tools / environments?) "
                                  f"is not supported with the rollout engine")


@contextlib.contextmanager
def _reference_model(ref_model: nn.Module | None):
    """While GRPOTrainer.__init__ runs, its `create_model_from_path` (called for the policy
    only when the policy is given by name, which `ref_model` excludes) returns `ref_model`:
    TRL then prepares it as its own (dropout off, fused head, accelerator.prepare)."""
    if ref_model is None:
        yield
        return
    real = _grpo_module.create_model_from_path
    _grpo_module.create_model_from_path = lambda *args, **kwargs: ref_model
    try:
        yield
    finally:
        _grpo_module.create_model_from_path = real


class RolloutGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose rollouts come from an engine on this rank's device.

    Importance-sampling correction: TRL applies `vllm_importance_sampling_correction` (ratio of
    the trainer's recomputed logprobs to the sampler's) only under `self.use_vllm`, and the same
    flag builds its vLLM backend in __init__. So __init__ runs with `use_vllm=False` (no vLLM),
    then sets `self.use_vllm = args.vllm_importance_sampling_correction`: TRL then always
    recomputes old logprobs, treats the engine's logprobs (returned by the rollout_func) as the
    sampling logprobs, applies the ratio and logs `sampling/*` metrics, exactly as for vLLM. Every
    other `use_vllm` branch in 1.16 is either the vLLM-only generation path (unused: rollout_func
    takes precedence) or tools, which this trainer refuses.
    """

    def __init__(self, model, reward_funcs=None, args=None, *positional,
                 engine_config: EngineConfig | None = None, sleep_level: int = 1,
                 ref_model: nn.Module | None = None, **kwargs):
        """`ref_model`: the frozen reference for the KL term (beta > 0). TRL itself reloads one
        from the policy's config path, which an in-memory model lacks (built from a config:
        TRL fails) or no longer matches (warm-started or edited after loading)."""
        if ref_model is not None and isinstance(model, str):
            raise ValueError("ref_model: pass the policy as a module too (TRL loads the "
                             "reference of a model given by name from that name)")
        if kwargs.get("rollout_func") is not None:
            raise ValueError("rollout_func: RolloutGRPOTrainer provides its own")
        if kwargs.get("tools") or kwargs.get("environment_factory"):
            raise ValueError("tools / environment_factory: multi-turn tool calling is not "
                             "supported with the rollout engine yet")
        if args is not None and args.use_vllm:
            raise ValueError("use_vllm: the rollout engine replaces vLLM; set use_vllm=False")
        self.rollout = EngineRollout(lambda t: build_engine(t, engine_config), sleep_level,
                                     seed=None if args is None else args.seed)
        with _reference_model(ref_model):
            super().__init__(model, reward_funcs, args, *positional, rollout_func=self.rollout,
                             **kwargs)
        # Built now so a bad EngineConfig fails here, not mid-training; asleep until used.
        self.engine = self.rollout.setup(self, synced=False)
        self.engine.sleep(sleep_level)
        self.use_vllm = bool(self.vllm_importance_sampling_correction)
        self.vllm_generation, self._last_loaded_step = _NoVLLM(), -1
        if (self.use_vllm and self.loss_type == "vespo"
                and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):
            # TRL checks this in __init__, where use_vllm was still False.
            raise ValueError("vllm_importance_sampling_mode: loss_type='vespo' needs "
                             "'token_truncate' or 'token_mask'")
