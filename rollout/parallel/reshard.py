"""update_weights' sources cut to this rank's part before anything is copied or gathered.

A full tensor (on the host or the device) is cut to a view of the rank's part (models/base.py
`rank_parts`), so a host tensor crosses to the device as 1/k of itself, not whole.

A DTensor (FSDP2: each rank of a 1-D mesh holds a Shard(d) of every weight) is re-sharded to
the tensor-parallel layout with no whole-weight gather: each rank needs some ranges of each
weight (its TP slice, all of it for replicated weights) and holds one chunk of it, so every rank
sends every other exactly the intersections of its chunk with what the other needs. Weights go
in buckets of about `bucket_bytes` of shards; per bucket, one all_gather_object of the ranges
each rank needs and one all_to_all_single of the data, skipped when every rank's needs lie in
its own shards (a column-parallel weight over a dim-0 sharded source of the same split: read in
place). Placements other than Shard/Replicate on a 1-D mesh (Partial, HSDP's 2-D meshes) fall
back to `full_tensor()` then the cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .shard import Concat, Slice

Cut = Slice | Concat | None


def _is_dtensor(tensor) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local")


def take(tensor: torch.Tensor, cut: Cut) -> torch.Tensor:
    return tensor if cut is None else cut.take(tensor)


@dataclass
class ReshardStats:
    """What re-sharding DTensor sources cost this rank: collectives issued (a fallback's
    whole-weight gather counts one), bytes received from other ranks by the exchanges (its own
    shards are read in place)."""

    collectives: int = 0
    received_bytes: int = 0


def rank_parts(named: Iterable[tuple[str, torch.Tensor]], cuts: dict[str, Cut],
               dtype: torch.dtype, bucket_bytes: int, stats: ReshardStats
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's part) for every source tensor whose name is in `cuts` (the ones the
    model keeps). Full tensors come out as views (a fused parameter's parts concatenated: a
    copy of the part only); DTensors on their shards' device, in `dtype`,
    after their bucket's exchange (so not in the order they came). Every rank of a DTensor's
    mesh must iterate the same names (the trainer's model alike on every rank)."""
    pending: list[tuple[str, torch.Tensor, Cut]] = []
    size = 0
    for name, tensor in named:
        if name not in cuts:
            continue
        cut = cuts[name]
        if not _is_dtensor(tensor):
            yield name, take(tensor, cut)
            continue
        if not _exchangeable(tensor):
            stats.collectives += 1
            yield name, take(tensor.full_tensor(), cut)
            continue
        if pending and pending[0][1].device_mesh != tensor.device_mesh:
            yield from _exchange(pending, dtype, stats)
            pending, size = [], 0
        pending.append((name, tensor, cut))
        # Counted from global shapes, alike on every rank: bucket boundaries must agree.
        size += tensor.numel() * dtype.itemsize // tensor.device_mesh.size()
        if size >= bucket_bytes:
            yield from _exchange(pending, dtype, stats)
            pending, size = [], 0
    if pending:
        yield from _exchange(pending, dtype, stats)


def _exchangeable(tensor) -> bool:
    from torch.distributed.tensor import Replicate, Shard

    return tensor.device_mesh.ndim == 1 and type(tensor.placements[0]) in (Shard, Replicate)


def _chunk(tensor, rank: int) -> tuple[int, int, int] | None:
    """(dim, start, end) of mesh rank `rank`'s shard of DTensor `tensor` (torch.chunk's split,
    as DTensor's Shard makes it), or None when every rank holds it whole (Replicate)."""
    placement = tensor.placements[0]
    if not hasattr(placement, "dim"):
        return None
    dim = placement.dim % tensor.dim()  # Shard(-1) names the last dim
    n = tensor.shape[dim]
    step = -(-n // tensor.device_mesh.size())
    return dim, min(n, rank * step), min(n, (rank + 1) * step)


def _needs(tensor, cut: Cut) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(dim, ranges) of `tensor` a rank's part takes, the dim non-negative as _chunk's is (the
    experts' cuts name theirs from the end: Slice(-2))."""
    if cut is None:
        return 0, ((0, tensor.shape[0]),)
    dim, ranges = cut.intervals()
    return dim % tensor.dim(), ranges


def _pieces(tensor, need, holder: int, needer: int):
    """What mesh rank `holder`'s shard of `tensor` contributes to rank `needer`, which needs
    `need`: (source region in the holder's shard, destination region in the needer's part),
    each as [(dim, start, length)]. A replicated tensor: the needer's own copy, whole."""
    dim, ranges = need
    chunk = _chunk(tensor, holder)
    if chunk is None and holder != needer:
        return []
    out, offset = [], 0
    for start, n in ranges:
        if chunk is None:
            out.append(([(dim, start, n)], [(dim, offset, n)]))
        elif chunk[0] == dim:  # sharded along the cut: the overlap of two ranges
            lo, hi = max(start, chunk[1]), min(start + n, chunk[2])
            if hi > lo:
                out.append(([(dim, lo - chunk[1], hi - lo)], [(dim, offset + lo - start, hi - lo)]))
        elif chunk[2] > chunk[1]:  # sharded across it: the holder's rows of the cut's columns
            rows = chunk[2] - chunk[1]
            out.append(([(dim, start, n)], [(dim, offset, n), (chunk[0], chunk[1], rows)]))
        offset += n
    return out


def _region(tensor: torch.Tensor, region) -> torch.Tensor:
    for dim, start, n in region:
        tensor = tensor.narrow(dim, start, n)
    return tensor


def _volume(region, shape) -> int:
    """Elements of `region` (its dims narrowed) of a tensor of `shape`."""
    sizes = list(shape)
    for dim, _, n in region:
        sizes[dim] = n
    return int(torch.Size(sizes).numel())


def _exchange(pending, dtype: torch.dtype, stats: ReshardStats):
    mesh = pending[0][1].device_mesh
    group, size, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    mine = [_needs(t, cut) for _, t, cut in pending]
    everyone: list = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    stats.collectives += 1
    locals_ = [t.to_local() for _, t, _ in pending]
    device = locals_[0].device
    parts = []
    for (_, t, _), (dim, ranges) in zip(pending, mine):
        shape = list(t.shape)
        shape[dim] = sum(n for _, n in ranges)
        parts.append(torch.empty(shape, dtype=dtype, device=device))
    # traffic[k][j]: elements mesh rank k's shards hold of rank j's needs, which every rank
    # computes alike from the needs and the global shapes, so all agree on whether to exchange.
    traffic = [[sum(_volume(dst, t.shape) for (_, t, _), need in zip(pending, everyone[j])
                    for _, dst in _pieces(t, need, k, j)) for j in range(size)]
               for k in range(size)]
    # Own pieces are copied in place; rank j gets, per weight in order, what this rank's shards
    # hold of its needs.
    sends = []
    for j in range(size):
        for (_, t, _), local, part, need in zip(pending, locals_, parts, everyone[j]):
            for src, dst in _pieces(t, need, me, j):
                if j == me:
                    _region(part, dst).copy_(_region(local, src))
                else:
                    sends.append(_region(local, src).reshape(-1).to(dtype))
    if any(traffic[k][j] for k in range(size) for j in range(size) if k != j):
        send_sizes = [0 if j == me else traffic[me][j] for j in range(size)]
        recv_sizes = [0 if k == me else traffic[k][me] for k in range(size)]
        received = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        sent = torch.cat(sends) if sends else torch.empty(0, dtype=dtype, device=device)
        dist.all_to_all_single(received, sent, recv_sizes, send_sizes, group=group)
        stats.collectives += 1
        stats.received_bytes += received.numel() * dtype.itemsize
        offset = 0
        for k in range(size):
            if k == me:
                continue
            for (_, t, _), part, need in zip(pending, parts, mine):
                for _, dst in _pieces(t, need, k, me):
                    view = _region(part, dst)
                    view.copy_(received[offset:offset + view.numel()].view(view.shape))
                    offset += view.numel()
    for (name, _, _), part in zip(pending, parts):
        yield name, part
