"""The rollout function TRL's GRPOTrainer calls (`rollout_func`), backed by the engine: one
request with n samples per repeated prompt, the engine awake for the call, its logprobs kept as
TRL's sampling logprobs (trl.py describes how prompts arrive and how tool turns follow)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import torch.distributed as dist
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation

from rollout import Engine, EngineConfig, SamplingParams
from rollout.fields import as_choice, as_int

from .colocate import ColocatedRollout
from .trl_support import SupportTable

EngineFactory = Callable[["GRPOTrainer"], Engine]
IMPORTANCE_RATIOS = ("untruncated", "full_policy", "on_support")


def behaviour_logprobs(sample, importance_ratio: str) -> list[float]:
    """The engine's logprobs TRL's importance ratio divides by: the untruncated ones, or the
    sampling logprobs (the truncated distribution each token was drawn from)."""
    return list(sample.logprobs if importance_ratio == "untruncated"
                else sample.sampling_logprobs)


def make_rollout_func(engine_or_factory: Engine | EngineFactory, sleep_level: int = 1,
                      seed: int | None = None, importance_ratio: str = "untruncated"
                      ) -> EngineRollout:
    """A `rollout_func(prompts, trainer)` for GRPOTrainer. `engine_or_factory`: an Engine, or a
    callable building one from the trainer at the first rollout (on its device, after
    `accelerator.prepare`). `seed`: makes sampling reproducible (mixed with rank and call).
    `importance_ratio`: EngineRollout's, but "on_support", which needs the trainer's side
    renormalised too (RolloutGRPOTrainer)."""
    if importance_ratio == "on_support":
        raise ValueError("importance_ratio='on_support': a plain GRPOTrainer computes its "
                         "logprobs over the whole vocabulary; use RolloutGRPOTrainer, which "
                         "renormalises them on the sampled support")
    return EngineRollout(engine_or_factory, sleep_level, seed, importance_ratio)


def build_engine(trainer: GRPOTrainer, config: EngineConfig | None = None) -> Engine:
    """An engine on this rank's device, built from the trainer's (possibly PEFT) model."""
    config = dataclasses.replace(config or EngineConfig(), device=trainer.accelerator.device)
    return Engine(trainer.model, config, tokenizer=getattr(trainer, "_tokenizer", None))


@dataclasses.dataclass
class _Session:
    """What one awake period of the engine (one trainer `_generate`, all its turns) measured."""

    before: object  # a snapshot of engine.stats at the start
    wake: float = 0.0
    sync: float = 0.0
    synced: bool = False
    generate_seconds: float = 0.0
    generate_calls: int = 0
    # First-turn prompt ids by length: a later turn's prompt starts with one of them, which
    # gives the completion budget TRL leaves it (see EngineRollout.generate_rows).
    origins: dict[int, set[tuple[int, ...]]] = dataclasses.field(default_factory=dict)


class EngineRollout:
    """The rollout_func object; `engine`, `colocated` and `last_metrics` are for inspection."""

    def __init__(self, engine_or_factory: Engine | EngineFactory, sleep_level: int = 1,
                 seed: int | None = None, importance_ratio: str = "untruncated") -> None:
        """`importance_ratio`: which engine logprobs TRL gets as the sampling logprobs its
        importance ratio divides by. "untruncated": log_softmax(logits / T), what TRL's own
        forward recomputes, so the ratio measures the engine-trainer mismatch alone;
        "full_policy": the truncated distribution each token was drawn from
        (Sample.sampling_logprobs), so under top-k/top-p/min-p the ratio also carries the
        truncation (below 1 on every kept token). "on_support" (the recipes' default): the
        same sampling logprobs, each completion's kept sets kept in `supports`
        (trl_support.py) for RolloutGRPOTrainer to renormalise TRL's side over them."""
        self.importance_ratio = as_choice("importance_ratio", importance_ratio,
                                          IMPORTANCE_RATIOS)
        # One table per trainer mode (trainer.model.training): an evaluation's generation
        # between two training steps of one generation batch must not clear the batch's.
        self.tables = {True: SupportTable(), False: SupportTable()}
        self.supports = self.tables[True]  # the last generation's
        if isinstance(engine_or_factory, Engine):
            self.engine, self._factory = engine_or_factory, None
        elif callable(engine_or_factory):
            self.engine, self._factory = None, engine_or_factory
        else:
            raise ValueError("engine_or_factory must be an Engine or a callable(trainer) -> Engine")
        self.sleep_level = as_int("sleep_level", sleep_level, 1, 2)
        self.seed = None if seed is None else as_int("seed", seed)
        self.colocated: ColocatedRollout | None = None
        self.calls = 0  # rollout_func calls (first turns)
        self.generate_calls = 0  # engine.generate calls, every turn
        # (mode, global step) of the last engine call and how many came before it at that key:
        # the seeds' counter, restored with the trainer state when a run resumes from a
        # checkpoint. Every turn of a multi-turn rollout is one more call at that key.
        self._at: tuple[int, int] | None = None
        self._index = 0
        self._session: _Session | None = None
        self._depth = 0
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

    @contextlib.contextmanager
    def session(self, trainer: GRPOTrainer):
        """The engine awake, holding the trainer's current weights, for the block; nests (only
        the outermost block wakes, syncs, sleeps and records the `rollout/*` metrics, which
        then cover every engine call made inside it)."""
        if self._depth:
            self._depth += 1
            try:
                yield self._session
            finally:
                self._depth -= 1
            return
        engine = self.setup(trainer)
        rollout = self.colocated
        rollout.model = trainer.model_wrapped  # DDP/DeepSpeed wrap it after __init__
        if trainer.optimizer is not None:  # made at train(); fused AdamW bumps no versions
            rollout.watch(trainer.optimizer)
        rollout.gather = lambda m: _gathered(trainer, m)
        session = _Session(before=dataclasses.replace(engine.stats))  # stats accumulate in place
        with rollout:
            # Read now: a ColocatedRollout block nested in this one rewrites the timings.
            session.wake, session.sync = rollout.timings["wake"], rollout.timings["sync"]
            session.synced = rollout.synced
            self._session, self._depth = session, 1
            try:
                yield session
            finally:
                self._session, self._depth = None, 0
        self._record(trainer, session, rollout.timings["sleep"])

    def __call__(self, prompts: list, trainer: GRPOTrainer) -> dict[str, list]:
        if getattr(trainer, "tools", None) and not isinstance(
                getattr(trainer, "vllm_generation", None), EngineGeneration):
            # A plain GRPOTrainer would generate the turns after a tool call with transformers
            # (and fail: those come without logprobs).
            raise ValueError("tools / environment_factory: use RolloutGRPOTrainer, which "
                             "generates every turn with the engine")
        engine = self.setup(trainer)
        prompt_ids = tokenize_prompts(prompts, trainer)
        sampling_params(trainer, engine)  # bad settings fail before the engine wakes
        self.supports = self.tables[trainer.model.training]
        self.supports.clear()  # a new generation batch of this mode
        with self.session(trainer):
            completion_ids, logprobs = self.generate_rows(trainer, prompt_ids, first_turn=True)
        self.calls += 1
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    def generate_rows(self, trainer: GRPOTrainer, prompt_ids: list[list[int]],
                      first_turn: bool = False) -> tuple[list[list[int]], list[list[float]]]:
        """One completion (ids, sampler logprobs) per row, in order; equal rows are one request
        with n = their count. Call inside `session`. A row that extends a first-turn prompt of
        this session (a later turn: prompt + completion so far + tool result) gets at most what
        is left of `max_completion_length`, the length TRL's tool loop truncates it to anyway.
        A tensor-parallel engine generates for its ranks' rows together (module docstring)."""
        session = self._session
        if session is None:
            raise RuntimeError("generate_rows: call it inside EngineRollout.session(trainer)")
        engine = self.engine
        prompt_ids, mine = _engine_rows(engine, prompt_ids)
        if first_turn:
            for ids in prompt_ids:
                session.origins.setdefault(len(ids), set()).add(tuple(ids))
        params = sampling_params(trainer, engine)
        on_support = self.importance_ratio == "on_support"
        if on_support:
            params = dataclasses.replace(params, return_support=True)
        at = (int(not trainer.model.training), trainer.state.global_step)
        self._index = self._index + 1 if at == self._at else 0
        self._at = at
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, ids in enumerate(prompt_ids):
            groups.setdefault(tuple(ids), []).append(i)
        keys, requests = [], []
        completion_ids: list = [[] for _ in prompt_ids]
        logprobs: list = [[] for _ in prompt_ids]
        for g, (key, rows) in enumerate(groups.items()):
            budget = self._budget(session, key, params.max_tokens, trainer)
            if budget <= 0:
                continue  # nothing left of the completion budget: an empty turn
            keys.append(key)
            requests.append(dataclasses.replace(params, n=len(rows), max_tokens=budget,
                                                seed=self._seed(trainer, g)))
        outs = []
        if keys:
            t0 = time.perf_counter()
            outs = self.colocated.generate([list(k) for k in keys], requests)
            session.generate_seconds += time.perf_counter() - t0
            session.generate_calls += 1
            self.generate_calls += 1
        for key, out in zip(keys, outs):
            if out.error is not None:  # e.g. non-finite logits: no completion to give TRL
                raise RuntimeError(f"the engine aborted a request of this generation batch: "
                                   f"{out.error}")
            for row, sample in zip(groups[key], out.samples):
                completion_ids[row] = list(sample.token_ids)
                logprobs[row] = behaviour_logprobs(sample, self.importance_ratio)
                if on_support:
                    self.supports.add(key, sample.token_ids, sample.support)
        return completion_ids[mine], logprobs[mine]

    @staticmethod
    def _budget(session: _Session, key: tuple[int, ...], max_tokens: int, trainer) -> int:
        limit = getattr(trainer, "max_completion_length", None)
        if limit is None:
            return max_tokens
        # The longest first-turn prompt the row starts with: should a shorter one be the true
        # origin (one prompt a prefix of another), the budget only comes out larger, and TRL
        # still truncates to its own.
        for length in sorted(session.origins, reverse=True):
            if length <= len(key) and key[:length] in session.origins[length]:
                return min(max_tokens, limit - (len(key) - length))
        return max_tokens

    def _seed(self, trainer: GRPOTrainer, group: int) -> int | None:
        if self.seed is None:
            return None  # the engine draws one per request
        # Keyed by the trainer's step, not by a count of calls, so a run resumed from a
        # checkpoint samples what the uninterrupted run sampled (and evaluations in between
        # leave training's samples alone). Ints only: hash() of str varies per process. Mixed
        # with the engine's first rank, so the ranks of a tensor-parallel engine draw alike.
        tp = self.engine.tp
        rank = dist.get_global_rank(tp.group, 0) if tp.size > 1 else \
            trainer.accelerator.process_index
        return hash((self.seed, rank, *self._at, self._index, group)) & ((1 << 63) - 1)

    def _record(self, trainer, session: _Session, sleep_seconds: float) -> None:
        before, after = session.before, self.engine.stats
        prompt = after.prompt_tokens - before.prompt_tokens
        generated = after.generated_tokens - before.generated_tokens
        seconds = session.generate_seconds
        m = {
            "rollout/tokens_per_second": generated / seconds if seconds else 0.0,
            "rollout/prefix_cache_hit_rate":
                (after.prompt_hit_tokens - before.prompt_hit_tokens) / prompt if prompt else 0.0,
            "rollout/generate_seconds": seconds,
            "rollout/generate_calls": float(session.generate_calls),  # turns
            "rollout/wake_seconds": session.wake,
            "rollout/sync_seconds": session.sync,
            "rollout/sleep_seconds": sleep_seconds,
            "rollout/weight_syncs": float(session.synced),
        }
        self.last_metrics = m
        # TRL's own per-step metric store: averaged and logged by GRPOTrainer.log(). Values are
        # this rank's (gathering them would make ranks wait on each other's generation).
        metrics = getattr(trainer, "_metrics", None)
        if metrics is not None:
            mode = "train" if trainer.model.training else "eval"
            for key, value in m.items():
                metrics[mode][key].append(value)


def _engine_rows(engine: Engine, rows: list[list[int]]) -> tuple[list[list[int]], slice]:
    """The rows of every rank of `engine`'s tensor-parallel group, in rank order, and where
    this rank's lie among them; `rows` itself on an engine of one rank."""
    tp = engine.tp
    if tp.size == 1:
        return rows, slice(0, len(rows))
    everyone: list = [None] * tp.size
    dist.all_gather_object(everyone, rows, group=tp.group)
    start = sum(len(r) for r in everyone[:tp.rank])
    return [row for r in everyone for row in r], slice(start, start + len(rows))


def _gathered(trainer: GRPOTrainer, model):
    """Full weights under ZeRO-3 (via TRL's own helper); a plain unwrap otherwise."""
    return unwrap_model_for_generation(
        model, trainer.accelerator,
        gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
        gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs)


def tokenize_prompts(prompts: list, trainer: GRPOTrainer) -> list[list[int]]:
    """The ids TRL's own generation path feeds its backend: `GRPOTrainer._tokenize_prompts`
    (chat template, `chat_template_kwargs`, the training chat template TRL may substitute, the
    tool schemas: all tools, or each row's environment's tools). Text only."""
    prompt_ids, images, multimodal_fields = trainer._tokenize_prompts(prompts)
    if images is not None or multimodal_fields:
        raise ValueError("prompts: images / multimodal inputs are not supported by the rollout "
                         "engine (text-only models)")
    return [list(ids) for ids in prompt_ids]


def check_generation_args(args) -> None:
    """GRPOConfig's generation settings the engine cannot honour: ValueError naming the field
    (RolloutGRPOTrainer asks before it builds the engine; a plain GRPOTrainer's rollout_func at
    its first rollout)."""
    if not args.temperature > 0:
        raise ValueError(f"temperature: TRL divides the policy's logits by it, so it must be "
                         f"> 0 (the engine would sample greedily), got {args.temperature}")
    if getattr(args, "repetition_penalty", 1.0) != 1.0:
        raise ValueError(f"repetition_penalty: the engine has none; got {args.repetition_penalty}, "
                         f"set it to 1.0")
    if args.generation_kwargs:
        raise ValueError(f"generation_kwargs: not supported by the engine; got "
                         f"{sorted(args.generation_kwargs)}")
    if getattr(args, "vllm_structured_outputs_regex", None):
        raise ValueError("vllm_structured_outputs_regex: the engine has no structured outputs")


def end_ids(trainer: GRPOTrainer) -> list[int]:
    """The ids TRL ends a completion on (its eos_token_ids, unset ones dropped)."""
    return [t for t in trainer.eos_token_ids if t is not None]


def completion_limit(args, engine: Engine) -> int:
    """A completion's token limit: TRL's max_completion_length, or (None) what the engine's
    context leaves, as TRL's vLLM path generates to its max_model_len."""
    return args.max_completion_length or engine.config.max_model_len


def sampling_params(trainer: GRPOTrainer, engine: Engine) -> SamplingParams:
    """GRPOConfig's generation settings as engine SamplingParams (n is set per prompt group)."""
    args = trainer.args
    check_generation_args(args)
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or 0,
        min_p=args.min_p or 0.0, max_tokens=completion_limit(args, engine),
        # TRL's end ids exactly (ignore_eos: not the engine's too, which may hold another the
        # model's config names): a sample TRL would go on with, or count as ended, must be one
        # the engine goes on with or ends
        stop_token_ids=end_ids(trainer), ignore_eos=True,
        logprobs=True)


class EngineGeneration:
    """Stands in for TRL's vLLM backend (`trainer.vllm_generation`) once `use_vllm` is on.

    TRL calls `sync_weights()` before a rollout (a no-op: the engine syncs itself when the
    weights changed, on waking) and, for every turn after a tool call,
    `generate(prompts=<token id lists>, images, num_generations, profiler)` from
    `_generate_single_turn`, which keeps `(_, completion_ids, logprobs, _)` with `logprobs` as
    vLLM's per-token top-k lists (it takes `lp[0]`). `_tool_call_loop` also reads
    `llm.llm_engine.model_config.max_model_len` (vllm_mode "colocate") to drop tool results that
    would not fit: the engine's limit. Anything else TRL might read is refused loudly."""

    def __init__(self, trainer: GRPOTrainer, rollout: EngineRollout) -> None:
        self._trainer = weakref.ref(trainer)  # the trainer holds this object
        self._rollout = rollout

    def sync_weights(self) -> None:
        pass

    @property
    def llm(self):
        config = SimpleNamespace(max_model_len=self._rollout.engine.config.max_model_len)
        return SimpleNamespace(llm_engine=SimpleNamespace(model_config=config))

    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1,
                 profiler=None) -> tuple:
        # num_generations: TRL passes the rows already repeated (1 in its tool loop); equal
        # rows become one request with n samples whatever it says.
        if images is not None and any(images):
            raise ValueError("images: not supported by the rollout engine (text-only models)")
        trainer = self._trainer()
        rows = [list(ids) for ids in prompts]
        with self._rollout.session(trainer), profiler or contextlib.nullcontext():
            completion_ids, logprobs = self._rollout.generate_rows(trainer, rows)
        return (rows, completion_ids, [[[lp] for lp in row] for row in logprobs],
                [[[t] for t in ids] for ids in completion_ids])

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"vllm_generation.{name}: this TRL path is not supported with "
                                  f"the rollout engine")
