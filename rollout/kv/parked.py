"""Parked K/V: carried samples' cached K/V kept on the host while the pool is dropped
(EngineConfig(carried_kv="park"), rollout/engine/carry.py).

`park` copies the K/V (and per-slot extras) of the prefix-cache paths of some keys to host
memory, each slot once however many keys share it (n samples of a prompt share their prompt);
`unpark` allocates slots in the pool again, writes the copies back and inserts every key into
the prefix cache, so the samples' re-admission matches their whole context and computes only
their newest token. The bits are the ones parked: under unchanged weights a resumed sample
attends to exactly the K/V it had.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..colocation.device_memory import host_copy, tensor_bytes
from .manager import KVManager


@dataclass
class ParkedKV:
    keys: list[list]  # prefix-cache keys (Sequence.cache_key), one per parked sample
    rows: list[torch.Tensor]  # for each key, the rows of `kv` that hold its slots, in order
    kv: torch.Tensor  # [2, layers, rows, kv_heads, head_dim] on the host
    extras: dict[str, torch.Tensor]  # the pool's per-slot extras of the same rows

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]

    @property
    def nbytes(self) -> int:
        return tensor_bytes((self.kv, *self.extras.values()))


def park(kv: KVManager, keys: list[list]) -> ParkedKV:
    """Host copies of what the prefix cache holds for each key's longest cached prefix.
    Reads only: the pool and the tree are left as they are."""
    cached = [kv.cache.peek(key) for key in keys]
    every = torch.cat(cached).cpu() if cached else torch.empty(0, dtype=torch.int64)
    slots, inverse = torch.unique(every, return_inverse=True)
    rows = list(inverse.split([c.numel() for c in cached]))
    pool = kv.pool
    slots = slots.to(pool.device)
    copy = _to_host(pool.buffer[:, :, slots])
    extras = {name: _to_host(extra[slots]) for name, extra in pool.extras.items()}
    return ParkedKV([key[:c.numel()] for key, c in zip(keys, cached)], rows, copy, extras)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A gathered copy on the host (on the CPU the gather made the copy already)."""
    return t if t.device.type == "cpu" else host_copy(t)


def unpark(kv: KVManager, parked: ParkedKV) -> None:
    """Write `parked` back into new slots and cache every key on them. Slots whose tokens the
    tree holds already (a sleep that failed before the pool went) go back to the pool. Inside
    a journal unit: an error undoes the slots and the inserts."""
    if parked.num_tokens == 0:
        return
    slots = kv.alloc(parked.num_tokens)
    if slots is None:
        raise RuntimeError(f"unpark: the pool has no room for {parked.num_tokens} parked "
                           f"tokens")
    pool = kv.pool
    pool.buffer[:, :, slots] = parked.kv.to(pool.device, non_blocking=True)
    for name, values in parked.extras.items():
        pool.extras[name][slots] = values.to(pool.device, non_blocking=True)
    taken = torch.zeros(parked.num_tokens, dtype=torch.bool)
    for key, rows in zip(parked.keys, parked.rows):
        already = kv.insert(key, slots[rows])
        taken[rows[already:]] = True
    kv.settle()  # the slots are the tree's now, or free again below
    kv.free(slots[~taken.to(slots.device)])
