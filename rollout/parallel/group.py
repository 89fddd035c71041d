"""The tensor-parallel group an engine runs on: k ranks of the trainer's torch.distributed world.

The launcher (torchrun, accelerate launch) or the trainer initialises torch.distributed; the
engine only carves its group out of that world (gloo on CPU, NCCL on GPUs: the world's
backend). With size 1 there is no group and no collective is ever issued, so a single-rank
engine runs exactly as before and needs no torch.distributed at all.
"""

from __future__ import annotations

import datetime
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    size: int = 1
    rank: int = 0  # within the group
    group: Any = None  # the torch.distributed ProcessGroup; None when size is 1


SINGLE = TensorParallel()
# What dist.new_group hands the ranks outside the group it makes (an int, not a ProcessGroup).
_NOT_A_MEMBER = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", object())


def tensor_parallel(size: int, group=None) -> TensorParallel:
    """This rank's group of `size` ranks: `group` when given (its size must be `size`), else
    consecutive ranks of the world (`dist.new_subgroups`: ranks 0..k-1 form one engine, k..2k-1
    the next), which is a collective over the whole world, so every rank builds its engine at
    the same point. ValueError naming `tensor_parallel_size` when that cannot be done."""
    if group is _NOT_A_MEMBER:
        raise ValueError("process_group: this rank is not a member of the group given (build "
                         "the engine on the group's own ranks only)")
    if group is not None and not isinstance(group, getattr(dist, "ProcessGroup", ())):
        raise ValueError(f"process_group must be a torch.distributed ProcessGroup or None, got "
                         f"{type(group).__name__}")
    if size == 1 and group is None:
        return SINGLE
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"tensor_parallel_size={size}: torch.distributed is not initialised; "
                         f"launch with torchrun / accelerate launch (or call "
                         f"dist.init_process_group) before building the Engine")
    if group is not None:
        ranks = dist.get_world_size(group)
        if ranks != size:
            raise ValueError(f"tensor_parallel_size={size}, but the process group given has "
                             f"{ranks} ranks")
    else:
        world = dist.get_world_size()
        if world % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the torch.distributed "
                             f"world size, {world}")
        group, _ = dist.new_subgroups(group_size=size, timeout=_world_timeout())
    return TensorParallel(size, dist.get_rank(group), group) if size > 1 else SINGLE


def _world_timeout() -> datetime.timedelta | None:
    """How long the world's collectives wait for a rank (init_process_group's `timeout`, the
    launcher's or the trainer's choice), for the engine's group to wait as long: new_subgroups
    gives a group torch's default otherwise (30 minutes on gloo, 10 on NCCL), whatever the
    trainer set. torch exposes it on the backend's options only (gloo's, NCCL's); None (that
    default) where a backend's options do not hold it."""
    world = dist.distributed_c10d._get_default_group()
    for device in world._device_types:
        options = getattr(world._get_backend(device), "options", None)
        timeout = getattr(options, "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def shared_seed(tp: TensorParallel, device: torch.device) -> int:
    """A random seed that every rank of the group draws alike (its rank 0's): unseeded
    requests take their seeds from it, and ranks must sample the same tokens."""
    seed = torch.tensor([random.getrandbits(63)], dtype=torch.int64, device=device)
    dist.broadcast(seed, src=dist.get_global_rank(tp.group, 0), group=tp.group)
    return int(seed.item())
