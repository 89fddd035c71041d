"""TRL (1.16) GRPOTrainer integration: every rollout comes from the engine in the trainer's process.

    trainer = RolloutGRPOTrainer(model, reward_funcs=..., args=GRPOConfig(...),
                                 train_dataset=..., processing_class=tok,
                                 engine_config=EngineConfig(kv_cache_tokens=65536,
                                                            max_model_len=2048),
                                 environment_factory=MyEnv)      # or tools=[fn, ...], or neither

or, with a plain GRPOTrainer, `rollout_func=make_rollout_func(engine)` (single turn only: TRL
then keeps the engine's logprobs as `sampling_per_token_logps` but applies no importance-sampling
correction, which is gated on `use_vllm`, and generates tool turns with transformers; see
RolloutGRPOTrainer).

How prompts arrive (read from grpo_trainer.py, not its docstring, which says "no duplication"):
the train sampler (RepeatSampler, `mini_repeat_count=num_generations`; eval: `num_generations_eval`)
repeats each prompt, accelerate gives every rank a contiguous slice of that stream, and
`_generate_and_score_completions` scores the i-th completion against the i-th input row. So the
rollout_func must return exactly one completion per entry of `prompts`, in order. We merge equal
prompts into one request with n = their count: the engine computes the shared prompt once.

Tools and environments (TRL's protocol: `tools=[fn]`, `environment_factory=Env` whose public
methods are tools, `reset(**row)`, optional `get_reward()`): TRL runs its own multi-turn loop
(`GRPOTrainer._generate` -> `_tool_call_loop`): it parses each turn with `parse_response`, calls the
tools, appends the template's tool-message ids to the sampled ids (never re-tokenising the
history), and generates the next turn through `_generate_single_turn`, which, with `use_vllm` on,
calls `self.vllm_generation.generate(prompts=<token ids>, ...)`. Here that is `EngineGeneration`:
the engine, token-in/token-out. The first turn still comes from the rollout_func (one request
with n samples per repeated prompt); every later turn is one engine call over the episodes that
called a tool, whose histories the radix cache serves (the engine stays awake for the whole
`_generate`, see RolloutGRPOTrainer._generate). TRL's tool mask (0 on tool-result tokens) and
the engine's logprobs (0.0 on tool-result tokens) reach the loss and the importance ratio.

Each rank runs its own engine on its own device; rollouts call no collective (a ZeRO-3 gather of
the weights aside, which every rank enters at the same point, before generating). With
`EngineConfig(tensor_parallel_size=k)` the engine spans k consecutive ranks (built in
RolloutGRPOTrainer.__init__, at the same point on every rank), whose requests must be the same,
while TRL hands each rank its own slice of the batch: so each rollout gathers the k ranks' rows
within the group (one all_gather_object), the engine generates for all of them, and each rank
keeps its own, as TRL's vLLM colocate mode does with its tensor-parallel group. Prompts are thus
sharded across engines, and the trainer stays data parallel over every rank. Tools and
environments need engines of one rank: a rank's tool loop may end while another's goes on.
FSDP-sharded models are not supported yet (their parameters would need full_tensor()).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import torch.distributed as dist
import trl.trainer.grpo_trainer as _grpo_module
from torch import nn
from trl import GRPOTrainer
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
                 seed: int | None = None) -> None:
        if isinstance(engine_or_factory, Engine):
            self.engine, self._factory = engine_or_factory, None
        elif callable(engine_or_factory):
            self.engine, self._factory = None, engine_or_factory
        else:
            raise ValueError("engine_or_factory must be an Engine or a callable(trainer) -> Engine")
        self.sleep_level, self.seed = sleep_level, seed
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
            for row, sample in zip(groups[key], out.samples):
                completion_ids[row], logprobs[row] = list(sample.token_ids), list(sample.logprobs)
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
                (after.cache_hit_tokens - before.cache_hit_tokens) / prompt if prompt else 0.0,
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


def sampling_params(trainer: GRPOTrainer, engine: Engine) -> SamplingParams:
    """GRPOConfig's generation settings as engine SamplingParams (n is set per prompt group)."""
    args = trainer.args
    if getattr(args, "repetition_penalty", 1.0) != 1.0:
        raise ValueError(f"repetition_penalty: the engine has none; got {args.repetition_penalty}, "
                         f"set it to 1.0")
    if args.generation_kwargs:
        raise ValueError(f"generation_kwargs: not supported by the engine; got "
                         f"{sorted(args.generation_kwargs)}")
    if getattr(args, "vllm_structured_outputs_regex", None):
        raise ValueError("vllm_structured_outputs_regex: the engine has no structured outputs")
    max_tokens = args.max_completion_length or engine.config.max_model_len
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or 0,
        min_p=args.min_p or 0.0, max_tokens=max_tokens,
        stop_token_ids=[t for t in trainer.eos_token_ids if t is not None], logprobs=True)


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
    """GRPOTrainer whose rollouts come from an engine on this rank's device, tool and
    environment turns included (`tools=`, `environment_factory=`: TRL 1.16's protocol).

    `use_vllm`: __init__ runs with `use_vllm=False` (the flag would build TRL's vLLM backend),
    then sets `self.use_vllm = True` and `self.vllm_generation = EngineGeneration(...)`,
    `self.vllm_mode = "colocate"`. In TRL 1.16 the flag then (a) routes every tool turn through
    `vllm_generation.generate` (`_generate_single_turn`), and (b) together with
    `vllm_importance_sampling_correction` (on by default) makes TRL always recompute the old
    logprobs, treat the engine's logprobs as the sampling logprobs, apply the importance
    ratio (`vllm_importance_sampling_mode`) over the loss mask (completion mask x tool mask) and log `sampling/*`
    metrics, exactly as for vLLM. Its other branches are vLLM-only setup in __init__ and the
    weight sync before each rollout (a no-op here). With the correction off, only (a) remains.

    The engine is awake for each whole `_generate` call (first turn, tool calls, later turns)
    and asleep otherwise, in particular at every optimizer step.
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
        if args is not None and args.use_vllm:
            raise ValueError("use_vllm: the rollout engine replaces vLLM; set use_vllm=False")
        if args is not None and args.use_transformers_continuous_batching:
            raise ValueError("use_transformers_continuous_batching: the rollout engine generates; "
                             "set it to False")
        self.rollout = EngineRollout(lambda t: build_engine(t, engine_config), sleep_level,
                                     seed=None if args is None else args.seed)
        with _reference_model(ref_model):
            super().__init__(model, reward_funcs, args, *positional, rollout_func=self.rollout,
                             **kwargs)
        if self._is_vlm:
            raise ValueError("processing_class: a multimodal processor (VLM); the rollout engine "
                             "serves text-only models")
        # Built now so a bad EngineConfig fails here, not mid-training, and, for a
        # tensor-parallel engine, at the same point on every rank; asleep until used.
        self.engine = self.rollout.setup(self, synced=False)
        if self.tools and self.engine.tp.size > 1:
            raise ValueError("tools / environment_factory: need tensor_parallel_size 1 (the "
                             "ranks of one engine must run the same turns, and each rank's "
                             "tool loop ends on its own)")
        self.engine.sleep(sleep_level)
        self.use_vllm, self.vllm_mode = True, "colocate"
        self.vllm_generation, self._last_loaded_step = EngineGeneration(self, self.rollout), -1
        if (self.vllm_importance_sampling_correction and self.loss_type == "vespo"
                and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):
            # TRL checks this in __init__, where use_vllm was still False.
            raise ValueError("vllm_importance_sampling_mode: loss_type='vespo' needs "
                             "'token_truncate' or 'token_mask'")

    def _generate(self, prompts: list):
        # One awake period for the whole rollout: the first turn (the rollout_func) and, with
        # tools, every later turn (EngineGeneration), so each turn's history is served by the
        # radix cache the previous turn filled; the engine sleeps when TRL has its completions.
        with self.rollout.session(self):
            return super()._generate(prompts)
