"""Which implementations a step runs: attention, sampler, draft acceptance, MoE experts, and
whether decode steps can be captured in CUDA graphs. Chosen here, once per model stack, from
`EngineConfig.backend`; nothing else in the engine looks at the name, the device or the class
of a backend.

- `torch`: the reference and the CPU default. TorchAttention (rollout/attention.py),
  rollout.sampler.sample, rollout.spec.accept.accept_drafts_ref, the experts of MoE layers one
  matmul pair per expert (rollout/models/layers/moe.py moe_torch); no CUDA graphs.
- `triton`: the CUDA default. TritonAttention (kernels/ paged and shared-prefix attention), the
  fused Triton sampler and acceptance scan, the fused MoE kernel (kernels/fused_moe.py), CUDA
  graphs. Off CUDA (tests, under TRITON_INTERPRET=1) attention runs its Triton kernels, but
  sampling, acceptance and the MoE experts take the torch versions: sampling and acceptance
  are bit-identical (tests/test_kernels_sample.py and test_kernels_spec_accept.py hold the
  kernels to them), the MoE kernel agrees with the reference to rounding
  (tests/test_kernels_fused_moe.py), and the interpreter would spend about 0.3 s a step on
  each.
- `auto`: triton on CUDA, torch elsewhere.

On CPU either backend's projections multiply by weights packed for oneDNN where it has a
kernel for their dtype (rollout/models/layers/packed_linear.py), unless
`EngineConfig.pack_cpu_weights` is off; in fp32 either backend's RMSNorm, rotary embedding and
gated-MLP SiLU, and the torch backend's decode, verify and later-turn attention, run in the C of
rollout/native, unless `EngineConfig.native_cpu_kernels` is off. (The sampler's Gumbel noise runs there too whenever
it builds: it gives torch's bits, so it is not a choice.)

Triton is imported only when the triton backend is built: on CPU, `rollout` needs torch alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from .attention import AttentionBackend, TorchAttention
from .kv_pool import KVPool
from .models.layers.moe import moe_torch
from .models.layers.packed_linear import NativePackedWeight, PackedWeight, can_pack
from .native import linear as native_linear
from .native import norm_rope
from .sampler import SamplingBatch, sample
from .spec.accept import accept_drafts_ref

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class Backends:
    name: str  # "torch" or "triton" ("auto" resolved)
    # (pool, per-layer sliding windows) -> the attention backend of a model stack
    attention: Callable[[KVPool, Sequence[int | None]], AttentionBackend]
    sample: Callable[[torch.Tensor, SamplingBatch], tuple[torch.Tensor, torch.Tensor]]
    accept: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # spec/verify.py's scan
    # (x, w_gate_up, w_down, topk_weights, topk_ids, activation) -> the experts' output
    moe: Callable[..., torch.Tensor]
    cuda_graphs: bool  # the attention backend provides graph_plan
    pack_cpu_weights: bool  # EngineConfig.pack_cpu_weights
    native_cpu_kernels: bool = False  # EngineConfig.native_cpu_kernels

    def packing(self, weight: torch.Tensor) -> PackedWeight | NativePackedWeight | None:
        """The packed copy a projection multiplies by instead of `weight` (CPU): panels for
        rollout/native's linear.c (fp32, native_cpu_kernels), else oneDNN's layout; None:
        `weight` itself."""
        if not self.pack_cpu_weights or not can_pack(weight.device, weight.dtype):
            return None
        if (self.native_cpu_kernels and weight.dtype == torch.float32
                and native_linear.supported()):
            return NativePackedWeight()
        return PackedWeight()

    def native_layer_ops(self, weight: torch.Tensor) -> bool:
        """Whether RMSNorm, rotary embedding and the gated MLP's SiLU of a model with this
        weight's device and dtype run in rollout/native's C (CPU, fp32)."""
        return self.native_cpu_kernels and norm_rope.supported(weight.device, weight.dtype)


def resolve_backends(name: str, device: torch.device, pack_cpu_weights: bool,
                     native_cpu_kernels: bool) -> Backends:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return Backends("torch", partial(TorchAttention, native=native_cpu_kernels), sample,
                        accept_drafts_ref, moe_torch, cuda_graphs=False,
                        pack_cpu_weights=pack_cpu_weights, native_cpu_kernels=native_cpu_kernels)
    on_cuda = device.type == "cuda"
    return Backends("triton", _triton_attention, _triton_sample if on_cuda else sample,
                    _triton_accept if on_cuda else accept_drafts_ref,
                    _triton_moe if on_cuda else moe_torch, cuda_graphs=True,
                    pack_cpu_weights=pack_cpu_weights, native_cpu_kernels=native_cpu_kernels)


def _triton_attention(pool: KVPool, windows: Sequence[int | None]) -> AttentionBackend:
    from .triton_attention import TritonAttention

    return TritonAttention(pool, windows)


def _triton_sample(logits: torch.Tensor, rows: SamplingBatch):
    """The fused Triton sampler; same noise and filters as rollout.sampler.sample."""
    from rollout_kernels import sample as kernel_sample

    return kernel_sample(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p,
                         rows.seed, rows.position)


def _triton_accept(**rows):
    from rollout_kernels.spec_accept import accept_drafts

    return accept_drafts(**rows)


def _triton_moe(x, w_gate_up, w_down, topk_weights, topk_ids, activation: str):
    """The fused MoE kernel; an activation it lacks takes the torch path."""
    from rollout_kernels.fused_moe import ACTIVATIONS, fused_moe

    if activation not in ACTIVATIONS:
        return moe_torch(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    return fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
