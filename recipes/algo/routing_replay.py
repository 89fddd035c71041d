"""Routing replay for MoE policies: the trainer's forward uses the experts the rollout used.

The engine samples with its own kernels, batch shapes and (often) weights one sync behind, so
the training forward's routers can pick other experts than the ones that produced a sample: the
importance ratio then compares two different networks. With `Sample.routed_experts` (the
engine's choices, rollout/requests/outputs.py), forward hooks on each MoE layer's router force its top-k
ids to the rollout's. The weights given to those experts are recomputed from the training
model's own router logits, normalised as the family normalises them, so gradients still flow
through the router probabilities; only the discrete choice is replayed.

The same hooks count the "flip rate": the share of routing decisions (token x MoE layer) where
the training model's own top-k set differs from the rollout's. Forced, it is the share replay
overrode; with `force=False` nothing changes and it is the share that routed apart.

Supported routers: transformers' Qwen3-MoE and Mixtral (`TopKRouter`, returning router logits,
top-k weights and top-k ids, which the block hands to its experts).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from rollout import RolloutOutput

ROUTERS = (Qwen3MoeTopKRouter, MixtralTopKRouter)


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of `model`'s MoE layers in layer order (dense layers have none), the order
    of the engine's routed_experts layer axis; works through DDP / value-head wrappers."""
    return [m for m in model.modules() if isinstance(m, ROUTERS)]


def routed_expert_batch(outputs: list[RolloutOutput], length: int, model: torch.nn.Module,
                        version: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The samples' routed experts in the training batch's token space (recipes/algo/batch.py:
    one row per sample, prompt + completion, right-padded to `length`): [N, length, MoE
    layers, k] in the engine's int16 (an int64 copy would hold 4x the memory on the device,
    3 KiB a padded position for Qwen3-30B-A3B). -1 marks positions whose routers keep their
    own choice, not counted in the flip rate: those the rollout never routed (the last token,
    padding, an aborted sample) and rows another weights version computed than `version`,
    the engine's version of the trainer's weights at the step's start (_of_version). None when
    no sample has routes (all aborted). Routes that cannot be `model`'s raise ValueError here,
    read on the host: routing_replay, entered for every micro-batch, would wait for the
    device to read them there."""
    samples = [s for out in outputs for s in out.samples]
    routes = next((s.routed_experts for s in samples if s.routed_experts is not None), None)
    if routes is None:
        return None
    out = torch.full((len(samples), length, *routes.shape[1:]), -1, dtype=routes.dtype)
    for i, sample in enumerate(samples):
        if sample.routed_experts is not None:
            out[i, :len(sample.routed_experts)] = _of_version(sample, version)
    routers = moe_routers(model)
    _check_router_sizes(out, routers)
    _check_expert_ids(out, routers[0].num_experts)
    return out.to(device)


def _of_version(sample, version: int) -> torch.Tensor:
    """The sample's route rows, -1 where `Sample.routed_versions` is not `version`. Replay
    serves the loss's forwards and the proximal policy the custom loop measures them against
    (the trainer's weights at the step's start, recomputed): it must route as those weights
    route. A sample carried across an update under carried_kv="recompute" had every row
    re-prefilled under them (their routing, up to the engine's kernels); under "park" its rows
    from before the update are the old weights' routing (docs/moe.md): forced, the trainer
    would train a network it never samples from, experts its routers do not choose. A sample
    finished under older weights and handed out later has no row of `version` at all."""
    stale = sample.routed_versions != version
    return sample.routed_experts.masked_fill(stale[:, None, None], -1)


class FlipCount:
    """Routing decisions seen and flipped, summed over every forward under the hooks. Kept on
    the device, so reading `rate` is the only sync."""

    def __init__(self) -> None:
        self.flipped = self.total = 0

    @property
    def rate(self) -> float:
        return float(self.flipped / self.total) if int(self.total) else 0.0


@contextlib.contextmanager
def routing_replay(model: torch.nn.Module, routes: torch.Tensor, force: bool = True,
                   count: FlipCount | None = None):
    """Within the block, forwards of `model` over a batch laid out like `routes` ([N, L, MoE
    layers, k], routed_expert_batch's rows for the same samples) route each token the way the
    rollout did (`force`) and add their flips to `count` (a new FlipCount unless given), which
    the block gets. Keep backward inside the block under gradient checkpointing: the recompute
    must route alike (it counts its decisions again, which leaves the rate as it is). Routes
    laid out for another model raise ValueError on entry, from their shape alone: nothing
    waits for the device (routed_expert_batch checked their expert ids on the host)."""
    routers = moe_routers(model)
    _check_router_sizes(routes, routers)
    count = FlipCount() if count is None else count
    handles = [r.register_forward_hook(functools.partial(_replay, routes[:, :, i], force, count))
               for i, r in enumerate(routers)]
    try:
        yield count
    finally:
        for handle in handles:
            handle.remove()


def _check_router_sizes(routes: torch.Tensor, routers: list[torch.nn.Module]) -> None:
    """Another count of MoE layers or another top-k would only fail in the forward, as a
    layout mismatch. Reads the shape only."""
    if len(routers) != routes.shape[2]:
        raise ValueError(f"routes have {routes.shape[2]} MoE layers, the model "
                         f"{len(routers)} routers")
    if routers and routes.shape[-1] != routers[0].top_k:
        raise ValueError(f"routes: top-{routes.shape[-1]} routing, the model's routers take the "
                         f"top {routers[0].top_k}")


def _check_expert_ids(routes: torch.Tensor, num_experts: int) -> None:
    """An expert id past the experts would fail in the forward as gather's RuntimeError (on
    CUDA a device-side assert, which ends the process's CUDA context). `routes` on the host."""
    largest = int(routes.max()) if routes.numel() else -1
    if largest >= num_experts:
        raise ValueError(f"routes: expert ids up to {largest}, the model has {num_experts} "
                         f"experts")


def _replay(routes, force, count, router, args, out):
    logits, weights, own = out  # [T, E], [T, k], [T, k] over the flattened batch
    want = routes.reshape(-1, routes.shape[-1]).to(own.device, torch.long)
    if want.shape != own.shape:
        raise ValueError(f"routes for {tuple(want.shape)} routing decisions, the forward "
                         f"made {tuple(own.shape)}: not laid out like this batch")
    given = (want >= 0).all(-1, keepdim=True)  # [T, 1]: positions the rollout routed
    # A set, not a list: the same experts in another order compute the same output.
    flipped = (own.sort(-1).values != want.sort(-1).values).any(-1, keepdim=True) & given
    count.flipped = count.flipped + flipped.sum()
    count.total = count.total + given.sum()
    if not force:
        return None
    ids = want.clamp(min=0)
    chosen = logits.float().softmax(-1).gather(-1, ids)
    # Qwen3-MoE renormalises the top-k probabilities when norm_topk_prob; Mixtral always does.
    if getattr(router, "norm_topk_prob", True):
        chosen = chosen / chosen.sum(-1, keepdim=True)
    return (logits, torch.where(given, chosen.to(weights.dtype), weights),
            torch.where(given, ids, own))
