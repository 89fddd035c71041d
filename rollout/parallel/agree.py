"""What the ranks of one engine must agree on before they run together, checked with one small
collective each, so that a difference is an error on every rank at once rather than a rank
waiting forever in a collective the others never issue, or ranks sampling different tokens
without a word (the last token of a sample feeds no forward, so no per-step check sees it):
the config they were built with, the KV pool's size, the requests of each call, and whether a
sleep, wake-up or update went through on all of them."""

from __future__ import annotations

import dataclasses
import json

import torch
import torch.distributed as dist

from .collectives import check_same, digest
from .group import TensorParallel

# May differ per rank: where it runs, and how much memory each rank offers its pool (the pool
# takes the smallest: agree_min), and glibc's heap setting (process-wide, no collective).
PER_RANK_FIELDS = frozenset({"device", "kv_cache_tokens", "kv_memory_fraction",
                             "keep_cpu_heap"})
# Differ between two loads of one model (where it was read from, which library wrote it).
PER_LOAD_KEYS = frozenset({"_name_or_path", "transformers_version"})


def check_same_config(config, hf_config, tp: TensorParallel, device: torch.device) -> None:
    """Every rank built its engine with the same EngineConfig (but PER_RANK_FIELDS) and model
    config, or ValueError on every rank naming the fields that differ: one all-reduce."""
    model = {k: v for k, v in hf_config.to_dict().items() if k not in PER_LOAD_KEYS}
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in PER_RANK_FIELDS}
    fields["model config"] = json.dumps(model, sort_keys=True, default=str)
    names = list(fields)
    digests = [digest(fields[n]) for n in names]
    both = torch.tensor(digests + [-d for d in digests], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=tp.group)
    n = len(names)
    differ = [names[i] for i in range(n) if int(both[i]) != -int(both[n + i])]
    if differ:
        raise ValueError(f"{differ[0]}: the ranks of a tensor-parallel engine must be built "
                         f"alike; these differ across them: {', '.join(differ)} (rank "
                         f"{tp.rank} has {differ[0]}={fields[differ[0]]!r:.200})")


def agree_min(value: int, tp: TensorParallel, device: torch.device) -> int:
    """The smallest `value` of the ranks (the KV pool's tokens: every rank schedules the same
    batches, so each pool must hold what the smallest holds, and no more)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return int(t.item())


REQUESTS_DIFFER = ("queued different requests in this call (each rank must pass the same "
                   "prompts and params)")


def check_same_requests(checked, tp: TensorParallel, device: torch.device,
                        ints: list[int] = (), differ: str = REQUESTS_DIFFER) -> None:
    """Every rank queues the same requests in this call (their tokens and sampling params, and
    `ints`: what the call's other arguments come to), or RuntimeError on every rank saying the
    ranks of one engine `differ`: a rank handed none would otherwise return at once and the
    others wait for it at their first step, and a different seed or temperature samples
    differently with the same batch. `checked` None: this rank's arguments were refused (a
    row no call gives)."""
    rows = [[-1]] if checked is None else \
        [*([*ids, digest(params)] for _, ids, params in checked), [*ints]]
    here = " (refused here)" if checked is None else \
        f" ({len(checked)} here)" if checked else ""
    check_same(rows, tp, device, f"ranks of one engine {differ}{here}")


def agree_max(values: list[int], tp: TensorParallel, device: torch.device) -> list[int]:
    """Each value's largest over the ranks (one all-reduce): after a sleep, wake-up or update,
    whether it failed anywhere, the deepest sleep level and whether any rank lost weights."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=tp.group)
    return t.tolist()
