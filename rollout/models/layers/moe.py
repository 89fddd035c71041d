"""The sparse MoE block (Qwen3-MoE, Mixtral): a router and stacked experts, no shared expert.

- `gate`: the router, a bias-free linear [E, H] (checkpoint name `mlp.gate.weight`).
- `experts`: every expert's weights stacked, as transformers 5 keeps them: `gate_up_proj`
  [E, 2I, H] (gate rows, then up rows) and `down_proj` [E, H, I]. Checkpoints that name each
  expert (`experts.<e>.gate_proj.weight`, Mixtral's `w1`/`w3`/`w2`) are loaded into slices of
  these in place (models/base.py `Stacked`).
- routing as transformers does it: router logits in the model dtype, softmax in fp32, top-k;
  `normalize` rescales the top-k probabilities to sum to one (Mixtral always, i.e. a softmax
  over the top-k logits; Qwen3-MoE when `norm_topk_prob`); Qwen3-MoE rounds the weights to the
  model dtype before they scale the experts' outputs, Mixtral keeps them in fp32.
- each MoE layer's top-k expert ids are kept beside the step's K/V
  (`ctx.store_slot_values`), the routing a trainer replays (models/base.py ROUTED_EXPERTS,
  rollout/requests/outputs.py Sample.routed_experts).
- the experts themselves run as the engine's backend chooses (rollout/ops/backend.py):
  `moe_torch` below (the reference, and every backend off CUDA) or the Triton kernel
  (kernels/triton/fused_moe.py, on CUDA), with an unmerged LoRA adapter's delta where one is
  attached (layers/expert_lora.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import ACT2FN

from ...ops.op import Dispatched, always, on_cuda
from ...parallel import Concat, Slice, all_reduce, current, even_split
from ..base import LORA_MODULE, ROUTED_EXPERTS
from .expert_lora import ExpertBlock, ExpertLora, add_expert_delta
from .expert_packing import PackedExperts
from .packed_linear import Projection, packing_for

# (gate-up's, down's) adapter factors (A, B, scale), either None: ExpertLora.factors
ExpertFactors = tuple[tuple[torch.Tensor, torch.Tensor, float] | None, ...]


@dataclass(frozen=True)
class RouterOptions:
    num_experts: int
    top_k: int
    normalize: bool  # top-k probabilities rescaled to sum to 1
    weights_in_model_dtype: bool  # rounded to the model dtype before they scale the experts


def route(logits: torch.Tensor, options: RouterOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids [T, k]) from router logits [T, E]."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, options.top_k, dim=-1)
    if options.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if options.weights_in_model_dtype:
        weights = weights.to(logits.dtype).float()
    return weights, ids


def moe_torch(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str = "silu", lora: ExpertFactors | None = None,
              packed: PackedExperts | None = None) -> torch.Tensor:
    """The experts in torch, one batched matmul pair per expert that any token chose (as
    transformers' eager experts): x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I],
    topk_weights [T, k] fp32, topk_ids [T, k]; `lora`: the (A, B, scale) of an adapter on
    gate-up and on down, either None (layers/expert_lora.py). Same rounding points as
    kernels/triton/fused_moe.py, but for an adapter's delta, added here to the rounded base
    projection (the kernel adds it before its one rounding). `packed`: the experts' packed
    copies (the cpu backend's panels, or the batch-invariant packing) multiply instead of
    F.linear."""
    gate_up_lora, down_lora = lora or (None, None)
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_down.shape[0]).tolist()
    weights = topk_weights.reshape(-1)
    act = ACT2FN[activation]
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        rows = x[tokens]
        if packed is None:
            base_gate_up = F.linear(rows, w_gate_up[expert])
        else:
            base_gate_up = packed.linear(packed.gate_up[expert], rows, w_gate_up[expert])
        gate_up = add_expert_delta(base_gate_up, rows, gate_up_lora, expert)
        gate, up = gate_up.chunk(2, dim=-1)
        h = act(gate) * up
        if packed is None:
            base_down = F.linear(h, w_down[expert])
        else:
            base_down = packed.linear(packed.down[expert], h, w_down[expert])
        down = add_expert_delta(base_down, h, down_lora, expert)
        out.index_add_(0, tokens, (down.float() * weights[pairs, None]).to(x.dtype).float())
    return out.to(x.dtype)


class StackedExperts(nn.Module):
    """Under tensor parallelism every rank holds every expert, 1/k of each one's intermediate
    dimension (gate-up rows, down columns), like a dense MLP: the block then needs the one
    all-reduce a dense MLP needs, no token exchange, and every rank routes, computes and
    records the same experts. Expert parallelism (E/k whole experts per rank) would cost two
    all-to-alls per layer and leave ranks waiting on the one whose experts drew the most tokens;
    it pays off at batch sizes where 1/k-thin expert matmuls lose efficiency, not yet here."""

    def __init__(self, num_experts: int, hidden_size: int,
                 intermediate: tuple[str, int]) -> None:
        """`intermediate`: (its config field, an expert's intermediate size)."""
        super().__init__()
        self.tp = current()
        field, intermediate_size = intermediate
        start, local = even_split(intermediate_size, self.tp, field)
        self.num_experts, self.intermediate = num_experts, local
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local))
        # Along dim 0 of one expert's slice: what the per-expert gate and up tensors fill.
        self.shard_sizes = {"gate_up_proj": (local, local)}
        # Negative dims: the same cut for one expert's tensor and for all of them stacked.
        self._rows = Slice(-2, start, local, intermediate_size)
        self._cols = Slice(-1, start, local, intermediate_size)

    lora_active = False  # an unmerged LoRA adapter is attached (rollout/lora/layout.py)

    def lora_blocks(self) -> tuple[ExpertBlock, ...] | None:
        if not self.lora_active:
            return None
        return tuple(m.block for m in getattr(self, LORA_MODULE).values())

    def attach_lora(self, blocks: tuple[ExpertBlock, ...]) -> None:
        """Hold an adapter on each of `blocks`' parameters (zeros until copied), or none."""
        self.lora_active = False  # before the adapter goes: never half attached in a forward
        if hasattr(self, LORA_MODULE):
            delattr(self, LORA_MODULE)
        if blocks:
            held = {}
            for block in blocks:
                weight = getattr(self, block.attr)
                held[block.attr] = ExpertLora(self.num_experts, weight.shape[1], weight.shape[2],
                                              block, weight.device)
            setattr(self, LORA_MODULE, nn.ModuleDict(held))
            self.lora_active = True

    def lora_factors(self) -> ExpertFactors | None:
        if not self.lora_active:
            return None
        held = getattr(self, LORA_MODULE)
        return tuple(held[attr].factors() if attr in held else None
                     for attr in ("gate_up_proj", "down_proj"))

    def tp_slice(self, attr: str, shard: int | None) -> Slice | Concat | None:
        if self.tp.size == 1:
            return None
        if attr == "down_proj":
            return self._cols
        return self._rows if shard is not None else Concat((self._rows, self._rows), dim=-2)


class SparseMoE(Dispatched, nn.Module):
    """`moe_index`: this block's place among the model's MoE layers (the layer axis of the
    routed experts)."""

    takes_ctx = True  # the decoder layer passes ctx: the block records its routing there
    implementations = {"torch": always, "triton": on_cuda}

    def __init__(self, hidden_size: int, intermediate: tuple[str, int], act: str,
                 options: RouterOptions, moe_index: int) -> None:
        """`intermediate`: (its config field, an expert's intermediate size)."""
        super().__init__()
        self.options, self.activation, self.moe_index = options, act, moe_index
        self.gate = nn.Linear(hidden_size, options.num_experts, bias=False)
        self.experts = StackedExperts(options.num_experts, hidden_size, intermediate)

    packed: PackedExperts | None = None  # the packed copies, where projections are packed

    # The batch-invariant mode on the Triton backend (Backend.triton_rows), bound when the
    # engine builds the layer: the router's row-invariant linear and fused_moe with its
    # invariant tiles (functions), or None.
    rows_linear = rows_experts = None

    def use_backend(self, backend, dtype: torch.dtype) -> None:
        super().use_backend(backend, dtype)
        self.packed = self.rows_linear = self.rows_experts = None
        if backend.triton_rows:
            from rollout_kernels.triton.fused_moe import ACTIVATIONS, fused_moe
            from rollout_kernels.triton.row_invariant import linear

            if self.activation not in ACTIVATIONS:
                raise ValueError(f"batch_invariant: the MoE activation {self.activation!r} has "
                                 f"no fused Triton kernel (it has {', '.join(ACTIVATIONS)})")
            self.rows_linear = linear
            self.rows_experts = functools.partial(fused_moe, invariant=True)
            self.implementation = "triton"
            return
        make = functools.partial(packing_for, backend, dtype, Projection.implementations)
        if make() is None:
            return
        # The router's and every expert's matmuls go through packed copies, in moe_torch: on
        # the cpu backend the panels, in the batch-invariant mode the row-invariant packing
        # (F.linear rounds a row by how many rows share it).
        self.implementation = "torch"
        self.packed = PackedExperts(self.options.num_experts, make)

    # The packed copies' life, as a projection's (models/base.py finds these methods).
    def pack(self) -> None:
        if self.packed is not None:
            self.packed.pack(self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj)

    def drop_derived(self) -> None:
        if self.packed is not None:
            self.packed.drop()

    def derived_bytes(self) -> int:
        return 0 if self.packed is None else self.packed.nbytes()

    def forward_torch(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if self.packed is None:
            return self._forward(x, ctx, moe_torch)
        weights, ids = route(self.packed.linear(self.packed.router, x, self.gate.weight),
                             self.options)
        return self._experts(x, ctx, weights, ids,
                             functools.partial(moe_torch, packed=self.packed))

    def forward_triton(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if self.rows_experts is not None:
            weights, ids = route(self.rows_linear(x, self.gate.weight), self.options)
            return self._experts(x, ctx, weights, ids, self.rows_experts)
        from rollout_kernels.triton.fused_moe import ACTIVATIONS, fused_moe

        # An activation the kernel lacks takes the torch experts.
        return self._forward(x, ctx, fused_moe if self.activation in ACTIVATIONS else moe_torch)

    def _forward(self, x: torch.Tensor, ctx, experts: Callable[..., torch.Tensor]) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.gate.weight), self.options)
        return self._experts(x, ctx, weights, ids, experts)

    def _experts(self, x: torch.Tensor, ctx, weights: torch.Tensor, ids: torch.Tensor,
                 experts: Callable[..., torch.Tensor]) -> torch.Tensor:
        ctx.store_slot_values(ROUTED_EXPERTS, self.moe_index, ids)
        out = experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids,
                      self.activation, self.experts.lora_factors())
        return all_reduce(out, self.experts.tp)  # each rank's part of every expert's down
