"""EngineConfig: the engine's sizes and policies, validated at construction."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

import torch

from .fields import INT32_MAX, SEED_LIMIT, as_bool, as_choice, as_float, as_int, show
from .ops.backend import BACKENDS

DEFAULT_MAX_MODEL_LEN = 4096
SCHEDULE_POLICIES = ("fcfs", "lpm")
STALE_POLICIES = ("restart", "drop", "keep")  # what a group past max_staleness becomes
CARRIED_KV = ("recompute", "park")  # what a sample carried mid-way resumes from
LORA_MODES = ("auto", "unmerged", "merged")  # how a PEFT LoRA model is served (rollout/lora/)
# What the Triton kernels run and are tested in: their tile sizes and dot precision assume 2- or
# 4-byte floats (kernels/triton/paged_attention.py), so float64 is not among them.
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# The keys `extra` takes, each a bool. Testing options (README), not a free-form bag: a key
# nothing reads (a typo) is refused rather than ignored. separate_host_memory: a CPU engine
# parks and syncs its weights as a GPU's (rollout/colocation/parking.py).
SEPARATE_HOST_MEMORY = "separate_host_memory"
EXTRA_KEYS = (SEPARATE_HOST_MEMORY,)


@dataclass
class EngineConfig:
    # KV pool size in tokens; None sizes it from what max_num_seqs x max_model_len can use,
    # capped by `kv_memory_fraction` of free memory and, on the CPU, by a build-time budget
    # (rollout/kv/pool.py, CPU_POOL_BYTES).
    kv_cache_tokens: int | None = None
    kv_memory_fraction: float = 0.3
    # Prompt + output tokens of one sequence, at most the model's context (context_length in
    # rollout/models/layers/rotary.py); None: DEFAULT_MAX_MODEL_LEN, or that context if shorter.
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # "lpm" admits the longest cached prefix first (the oldest waiting request goes first once
    # passed over 16 times: scheduler.py LPM_PATIENCE); above `lpm_max_waiting` waiting
    # requests the sort costs more than it saves and admission falls back to fcfs.
    schedule_policy: str = "lpm"
    lpm_max_waiting: int = 128
    enable_prefix_caching: bool = True
    # Which implementation of every op runs (rollout/ops/backend.py): "torch" (the reference),
    # "cpu" (the C kernels of rollout_kernels.cpu), "triton", or "auto" (triton on CUDA, cpu
    # on the CPU).
    backend: str = "auto"
    # Replay decode-only steps from CUDA graphs (rollout/executor/cuda_graph.py); needs the
    # Triton backend. Off by default until a GPU run has measured it.
    cuda_graphs: bool = False
    # cpu backend: projections and MoE experts multiply by a packed copy of the weights
    # (panels for the C kernel in fp32, else oneDNN's layout: rollout/models/layers/
    # packed_linear.py), which doubles the weights' memory. False: F.linear on the weights.
    pack_cpu_weights: bool = True
    # CPU, process-wide: glibc keeps freed blocks below 32 MB in the heap for reuse, so a
    # step's [batch, vocab] temporaries (a filtered draw's; an unfiltered one draws a block of
    # rows at a time and has none) do not page-fault anew every step (rollout/colocation/
    # host_heap.py; given back at sleep). It changes malloc's behaviour for the whole trainer
    # process, so it is the caller's choice; a user's own MALLOC_* / GLIBC_TUNABLES settings
    # are left alone.
    keep_cpu_heap: bool = False
    # A request's tokens and logprobs are the same bits whatever else is in the batch: how its
    # prefill is chunked, what the radix cache held, who shares its steps, preemption and
    # speculation change nothing (docs/backends.md: on the CPU, cpu backend or triton under
    # the interpreter). Its cost: docs/benchmarks.md.
    batch_invariant: bool = False
    dtype: torch.dtype | str | None = None  # None: the model's dtype
    # torch.float32: a bf16/fp16 model's logits multiply an fp32 copy of the LM head by the
    # hidden state in fp32 (no rounding of the logits to the model's dtype; the copy is
    # derived like the packed weights: made again after update_weights, dropped at sleep,
    # counted in memory_held). None: the head in the model's dtype.
    lm_head_dtype: torch.dtype | str | None = None
    # A PEFT LoRA model (built from or synced with): "unmerged" serves its adapter beside the
    # base weights, loaded once (update_weights then copies the adapter only; rollout/lora/),
    # refusing adapters it cannot serve so; "merged" folds the adapter into the weights at
    # every sync; "auto" serves unmerged what it can and merges the rest (DoRA and other
    # variants, several active adapters, LoRA on embeddings or on one expert's linear, MoE
    # experts in the batch-invariant mode: Engine.lora_status says why).
    lora: str = "auto"
    device: torch.device | str | None = None  # None: the model's device (cuda if loading a path)
    seed: int | None = None  # default seed of unseeded requests; None draws one per request
    speculative: Any = None  # rollout.spec.SpeculativeConfig, off by default
    # Ranks of the trainer's torch.distributed world that run one engine together, each with
    # 1/k of the heads, MLP and vocabulary (rollout/parallel/); 1: no torch.distributed needed.
    tensor_parallel_size: int = 1
    # Debug: after every step the ranks of a tensor-parallel engine check (one small
    # all-reduce) that they sampled the same tokens.
    check_tensor_parallel: bool = False
    # Partial rollouts (rollout/engine/carry.py): after update_weights, a group still carried
    # whose oldest token is more than `max_staleness` versions old is restarted from its prompt,
    # dropped or kept (`stale_groups`); None: any age.
    max_staleness: int | None = None
    stale_groups: str = "restart"
    # What a sample carried mid-way across sleep or update_weights resumes from: "recompute"
    # re-prefills its context under the weights the engine then holds (siblings share their
    # prompt through the prefix cache); "park" keeps its K/V: on the host while the engine
    # sleeps, in the prefix cache across an update, where it goes on from the old weights'
    # K/V that no fresh request shares (docs/partial-rollouts.md). "park" needs prefix caching.
    carried_kv: str = "recompute"
    extra: dict = field(default_factory=dict)  # testing options: EXTRA_KEYS
    attention_backend: str | None = None  # the former name of `backend`, still accepted

    def __post_init__(self) -> None:
        # Sizes count tokens that int32 tensors index: slot ids (in the CUDA graphs' kv_indices),
        # positions, qo_indptr/kv_indptr.
        if self.kv_cache_tokens is not None:
            self.kv_cache_tokens = as_int("kv_cache_tokens", self.kv_cache_tokens, 1, INT32_MAX)
        self.kv_memory_fraction = as_float("kv_memory_fraction", self.kv_memory_fraction)
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        # A prompt needs a token and room for one generated token.
        if self.max_model_len is not None:  # (None: the engine sets it from the model)
            self.max_model_len = as_int("max_model_len", self.max_model_len, 2, INT32_MAX)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            setattr(self, name, as_int(name, getattr(self, name), 1, INT32_MAX))
        if self.max_model_len is not None and self.max_num_seqs * self.max_model_len > INT32_MAX:
            raise ValueError(f"max_num_seqs * max_model_len must be <= 2**31 - 1 (a step's int32 "
                             f"kv_indptr sums its sequences' lengths), got {self.max_num_seqs} * "
                             f"{self.max_model_len}")
        self.lpm_max_waiting = as_int("lpm_max_waiting", self.lpm_max_waiting, 1)
        self.schedule_policy = as_choice("schedule_policy", self.schedule_policy,
                                         SCHEDULE_POLICIES)
        self.backend = as_choice("backend", self.backend, BACKENDS)
        if self.attention_backend is not None:
            alias = as_choice("attention_backend", self.attention_backend, BACKENDS)
            if self.backend not in ("auto", alias):
                raise ValueError(f"attention_backend (the former name of backend) is {alias!r} "
                                 f"but backend is {self.backend!r}: set backend only")
            self.backend, self.attention_backend = alias, None
        self.enable_prefix_caching = as_bool("enable_prefix_caching", self.enable_prefix_caching)
        self.cuda_graphs = as_bool("cuda_graphs", self.cuda_graphs)
        self.pack_cpu_weights = as_bool("pack_cpu_weights", self.pack_cpu_weights)
        self.keep_cpu_heap = as_bool("keep_cpu_heap", self.keep_cpu_heap)
        self.batch_invariant = as_bool("batch_invariant", self.batch_invariant)
        self.tensor_parallel_size = as_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.batch_invariant and self.tensor_parallel_size > 2:
            # Two ranks' partial sums add as a + b in any order; three or more in an order the
            # collective library chooses by the message's size, i.e. by the batch.
            raise ValueError(f"batch_invariant: tensor_parallel_size must be at most 2, got "
                             f"{self.tensor_parallel_size}")
        self.check_tensor_parallel = as_bool("check_tensor_parallel", self.check_tensor_parallel)
        if self.dtype is not None:
            self.dtype = as_dtype(self.dtype)
        if self.lm_head_dtype is not None:
            self.lm_head_dtype = as_dtype(self.lm_head_dtype, "lm_head_dtype")
            if self.lm_head_dtype != torch.float32:
                raise ValueError(f"lm_head_dtype must be None or torch.float32, got "
                                 f"{self.lm_head_dtype}")
        if self.device is not None:
            self.device = as_device(self.device)
        if self.seed is not None:
            self.seed = as_int("seed", self.seed, 0, SEED_LIMIT - 1)
        if self.max_staleness is not None:
            self.max_staleness = as_int("max_staleness", self.max_staleness, 0)
        self.stale_groups = as_choice("stale_groups", self.stale_groups, STALE_POLICIES)
        self.carried_kv = as_choice("carried_kv", self.carried_kv, CARRIED_KV)
        if self.carried_kv == "park" and not self.enable_prefix_caching:
            raise ValueError("carried_kv='park' needs enable_prefix_caching=True: parked K/V "
                             "goes back through the prefix cache")
        self.lora = as_choice("lora", self.lora, LORA_MODES)
        self.extra = check_extra(self.extra)
        if self.speculative is not None:
            from .spec.config import SpeculativeConfig

            if not isinstance(self.speculative, SpeculativeConfig):
                raise ValueError("speculative must be a rollout.spec.SpeculativeConfig or None")
            # Its own checked copy (replace reruns the checks), as the engine takes of this
            # config: a field set after construction is checked, a caller's later edits do
            # not reach a running engine.
            self.speculative = dataclasses.replace(self.speculative)


def known_fields(overrides: dict) -> dict:
    """Engine(**overrides) as EngineConfig fields: an unknown keyword, a typo or a field
    since gone, is a ValueError naming it (dataclasses.replace would raise a TypeError)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        close = difflib.get_close_matches(unknown[0], fields, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{unknown[0]}: not an EngineConfig field{hint}; the fields are "
                         f"{', '.join(sorted(fields))}")
    return overrides


def check_extra(extra) -> dict:
    """A copy of `extra` (so later edits of the caller's dict don't reach the engine), every
    key known and its value a bool."""
    if not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict of testing options (keys {EXTRA_KEYS}), got "
                         f"{show(extra)}")
    for key in extra:
        if not isinstance(key, str) or key not in EXTRA_KEYS:
            raise ValueError(f"extra: unknown key {show(key)}; the known keys are {EXTRA_KEYS}")
    return {key: as_bool(f"extra[{key!r}]", value) for key, value in extra.items()}


def as_dtype(value, name: str = "dtype") -> torch.dtype:
    """A torch dtype (or its name, 'torch.' optional) the engine runs in."""
    dtype = DTYPES.get(value.removeprefix("torch.")) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES.values():
        raise ValueError(f"{name} must be one of {', '.join(DTYPES)} (a str or torch.dtype), "
                         f"got {show(value)}")
    return dtype


def as_device(value) -> torch.device:
    """Parsed only: whether this process has the device is checked when the engine starts."""
    if isinstance(value, (str, torch.device)):
        try:
            device = torch.device(value)
        except RuntimeError:
            device = None
        # (torch takes any index for the CPU and reads none: 'cpu:7' would run on the one CPU)
        if device is not None and not (device.type == "cpu" and device.index not in (None, 0)):
            return device
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<index>' (a str or torch.device), "
                     f"got {show(value)}")
