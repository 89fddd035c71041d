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
import inspect

import trl.trainer.grpo_trainer as _grpo_module
from torch import nn
from trl import GRPOConfig, GRPOTrainer

from rollout import EngineConfig
from rollout.colocation.weights import is_peft

from .trl_rollout import (EngineGeneration, EngineRollout, build_engine, check_generation_args,
                          make_rollout_func)
from .trl_support import on_support_logps

__all__ = ["EngineGeneration", "RolloutGRPOTrainer", "make_rollout_func"]


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
    ratio (`vllm_importance_sampling_mode`) over the loss mask (completion mask x tool mask) and
    log `sampling/*` metrics, exactly as for vLLM. Its other branches are vLLM-only setup in __init__ and the
    weight sync before each rollout (a no-op here). With the correction off, only (a) remains.

    The engine is awake for each whole `_generate` call (first turn, tool calls, later turns)
    and asleep otherwise, in particular at every optimizer step.
    """

    def __init__(self, model, reward_funcs=None, args=None, *positional,
                 engine_config: EngineConfig | None = None, sleep_level: int = 1,
                 ref_model: nn.Module | None = None, importance_ratio: str = "untruncated",
                 **kwargs):
        """`ref_model`: the frozen reference for the KL term (beta > 0). TRL itself reloads one
        from the policy's config path, which an in-memory model lacks (built from a config:
        TRL fails) or no longer matches (warm-started or edited after loading).
        `importance_ratio`: "untruncated", "full_policy" or "on_support"
        (trl_rollout.EngineRollout; "on_support": the policy's logprobs renormalised on each
        token's sampled support, trl_support.py; single turns only)."""
        if engine_config is not None and not isinstance(engine_config, EngineConfig):
            raise ValueError(f"engine_config must be an EngineConfig or None, got "
                             f"{type(engine_config).__name__}")
        if ref_model is not None and isinstance(model, str):
            raise ValueError("ref_model: pass the policy as a module too (TRL loads the "
                             "reference of a model given by name from that name)")
        if ref_model is not None:
            # TRL builds no reference at beta 0 (its default), and with PEFT takes it from the
            # policy itself: the given one would be dropped without a word.
            given = inspect.signature(GRPOTrainer.__init__).bind_partial(
                self, model, reward_funcs, args, *positional, **kwargs).arguments
            if given.get("peft_config") is not None or is_peft(model):
                raise ValueError("ref_model: with PEFT, TRL takes the reference from the policy "
                                 "itself (a frozen copy of a wrapped model's adapter, or the "
                                 "base with the adapter off when it wraps the model from "
                                 "peft_config); drop ref_model")
            if (args.beta if args is not None else GRPOConfig().beta) == 0:
                raise ValueError("ref_model: TRL uses no reference at beta=0 (its default); "
                                 "set beta > 0 for a KL term, or drop ref_model")
        if kwargs.get("rollout_func") is not None:
            raise ValueError("rollout_func: RolloutGRPOTrainer provides its own")
        if args is not None and args.use_vllm:
            raise ValueError("use_vllm: the rollout engine replaces vLLM; set use_vllm=False")
        if args is not None and args.use_transformers_continuous_batching:
            raise ValueError("use_transformers_continuous_batching: the rollout engine generates; "
                             "set it to False")
        if args is not None:
            check_generation_args(args)
        self.rollout = EngineRollout(lambda t: build_engine(t, engine_config), sleep_level,
                                     seed=None if args is None else args.seed,
                                     importance_ratio=importance_ratio)
        with _reference_model(ref_model):
            super().__init__(model, reward_funcs, args, *positional, rollout_func=self.rollout,
                             **kwargs)
        if self._is_vlm:
            raise ValueError("processing_class: a multimodal processor (VLM); the rollout engine "
                             "serves text-only models")
        if self.tools and importance_ratio == "on_support":
            raise ValueError("importance_ratio='on_support': tool and environment turns put "
                             "tokens the engine did not sample into the completion; use "
                             "'untruncated' or 'full_policy'")
        if self.tools and engine_config is not None and engine_config.tensor_parallel_size > 1:
            raise ValueError("tools / environment_factory: need tensor_parallel_size 1 (the "
                             "ranks of one engine must run the same turns, and each rank's "
                             "tool loop ends on its own)")
        if (self.vllm_importance_sampling_correction and self.loss_type == "vespo"
                and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):
            # TRL checks this in __init__, where use_vllm was still False.
            raise ValueError("vllm_importance_sampling_mode: loss_type='vespo' needs "
                             "'token_truncate' or 'token_mask'")
        # Built now, after every refusal (an engine would hold its memory), so a bad
        # EngineConfig fails here, not mid-training, and, for a tensor-parallel engine, at the
        # same point on every rank; asleep until used.
        self.engine = self.rollout.setup(self, synced=False)
        self.engine.sleep(sleep_level)
        self.use_vllm, self.vllm_mode = True, "colocate"
        self.vllm_generation, self._last_loaded_step = EngineGeneration(self, self.rollout), -1

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        # The policy and the reference (its KL term) alike: both on the sampled support.
        if self.rollout.importance_ratio != "on_support":
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **multimodal)
        # (the policy's mode, not `model`'s: the reference model stays in eval mode)
        return on_support_logps(model, self.rollout.tables[self.model.training], input_ids,
                                attention_mask, logits_to_keep, self.temperature,
                                batch_size or input_ids.size(0), compute_entropy,
                                compute_aux_loss, self.accelerator.autocast)

    def _generate(self, prompts: list):
        # One awake period for the whole rollout: the first turn (the rollout_func) and, with
        # tools, every later turn (EngineGeneration), so each turn's history is served by the
        # radix cache the previous turn filled; the engine sleeps when TRL has its completions.
        with self.rollout.session(self):
            return super()._generate(prompts)
