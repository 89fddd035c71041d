"""EngineConfig: the engine's sizes and policies, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SCHEDULE_POLICIES = ("fcfs", "lpm")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class EngineConfig:
    # KV pool size in tokens; None sizes it from `kv_memory_fraction` of free memory.
    kv_cache_tokens: int | None = None
    kv_memory_fraction: float = 0.3
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # "lpm" admits the longest cached prefix first; above `lpm_max_waiting` waiting requests the
    # sort costs more than it saves and admission falls back to fcfs.
    schedule_policy: str = "lpm"
    lpm_max_waiting: int = 128
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    # Replay decode-only steps from CUDA graphs (rollout/cuda_graph.py); needs the Triton
    # backend. Off by default until a GPU run has measured it.
    cuda_graphs: bool = False
    dtype: torch.dtype | str | None = None  # None: the model's dtype
    device: torch.device | str | None = None  # None: the model's device (cuda if loading a path)
    seed: int | None = None  # default seed of unseeded requests; None draws one per request
    speculative: Any = None  # rollout.spec.SpeculativeConfig, off by default
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1 or None, got {self.kv_cache_tokens}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "lpm_max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, "
                             f"got {self.schedule_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.speculative is not None:
            from .spec.config import SpeculativeConfig

            if not isinstance(self.speculative, SpeculativeConfig):
                raise ValueError("speculative must be a rollout.spec.SpeculativeConfig or None")
        if isinstance(self.dtype, str):
            self.dtype = resolve_dtype(self.dtype)


def resolve_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must name a torch dtype (e.g. 'bfloat16'), got {name!r}")
    return dtype
