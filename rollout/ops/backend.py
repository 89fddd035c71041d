"""Which implementation of every operation an engine runs, chosen in one place from
`EngineConfig.backend`.

- `torch`: the reference. Plain torch ops everywhere: SDPA attention with the shared-prefix
  split (rollout/attention/sdpa.py), torch RMSNorm, rotary and SiLU, `F.linear` projections, the
  torch sampler and acceptance scan, MoE experts one matmul pair each.
- `cpu`: the CPU default. The C kernels of rollout_kernels.cpu (compiled at first use) where one
  exists for the op and dtype: paged attention for decode, verify and later-turn rows, RMSNorm,
  rotary, SiLU, Gumbel-max sampling, fp32 projections on weights packed in panels (oneDNN's packed
  layout for bf16 where the CPU has it). An op without a C kernel, or a library that did not
  build (no compiler, ROLLOUT_NATIVE=0), runs its torch implementation.
- `triton`: the CUDA default. The Triton kernels of rollout_kernels.triton: paged and
  shared-prefix attention, the fused sampler and acceptance scan, fused MoE; CUDA graphs; in the
  batch-invariant mode also the projections, RMSNorm and LoRA (kernels/triton/row_invariant.py).
  Off CUDA attention runs Triton (under TRITON_INTERPRET=1, which the process must set before
  anything imports triton kernels), and in the batch-invariant mode the ops just named; the
  other ops take their torch implementation.
- `auto`: triton on CUDA, cpu on the CPU.

Every op lists its implementations with one `supported(device, dtype)` check each
(rollout/ops/op.py); a backend tries its own, then torch's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from rollout_kernels import cpu as native
from rollout_kernels.cpu import linear as native_linear

from .op import Op, Supported

BACKENDS = ("auto", "torch", "cpu", "triton")
# What each backend tries, in order: its own implementation, then the reference.
_FALLBACK = {"torch": ("torch",), "cpu": ("cpu", "torch"), "triton": ("triton", "torch")}


@dataclass(frozen=True)
class Backend:
    name: str  # "torch", "cpu" or "triton" ("auto" resolved)
    device: torch.device
    # cpu: projections multiply by a packed copy of their weight (EngineConfig.pack_cpu_weights)
    pack_weights: bool = True
    # EngineConfig.batch_invariant: ops whose per-row results do not depend on the other rows
    # (rollout/attention/invariant.py, packed_linear.invariant_packing and TritonRows)
    batch_invariant: bool = False

    def choose(self, implementations: Mapping[str, Supported], dtype: torch.dtype) -> str:
        """The name of the implementation this backend runs for an op on `dtype`."""
        for name in _FALLBACK[self.name]:
            supported = implementations.get(name)
            if supported is not None and supported(self.device, dtype):
                return name
        raise ValueError(f"no implementation of this op runs on {self.device} in {dtype}")

    def bind(self, op: Op, dtype: torch.dtype = torch.float32) -> Callable:
        return op.functions[self.choose(op.implementations, dtype)]

    @property
    def triton_rows(self) -> bool:
        """The batch-invariant mode on the Triton backend: the projections, RMSNorm, the MoE
        experts and LoRA take its row-invariant kernels (kernels/triton/row_invariant.py),
        under the interpreter too, where the default mode keeps torch's."""
        return self.batch_invariant and self.name == "triton"

    @property
    def cuda_graphs(self) -> bool:
        """Decode steps can be captured (the Triton attention backend plans for graphs; off
        CUDA an eager stand-in keeps the contract, for tests)."""
        return self.name == "triton"


def resolve_backend(name: str, device: torch.device, pack_weights: bool = True,
                    batch_invariant: bool = False) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"backend 'cpu' runs on the CPU; this engine's device is {device}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend 'triton' off CUDA runs the kernels in Triton's interpreter: "
                         "set TRITON_INTERPRET=1 in the environment before the process imports "
                         "triton (the engine does not set it for you)")
    if batch_invariant:
        _check_invariant(name, device, pack_weights)
    return Backend(name, device, pack_weights, batch_invariant)


def _check_invariant(name: str, device: torch.device, pack_weights: bool) -> None:
    """Refuse a batch-invariant engine on what cannot keep its rows apart."""
    if name == "torch":
        raise ValueError("batch_invariant: backend 'torch' runs SDPA and F.linear, whose rows "
                         "round differently with the batch's shape; use backend 'cpu' or "
                         "'auto'")
    # The Triton backend multiplies by its own row-invariant kernel, whatever pack_weights.
    if name == "cpu" and not pack_weights:
        raise ValueError("batch_invariant: needs pack_cpu_weights=True (F.linear's rows round "
                         "differently with the number of rows)")
    if name == "cpu" and not native_linear.invariant_supported(device):
        raise ValueError("batch_invariant: the cpu backend multiplies through linear.c's "
                         "panels (F.linear's and oneDNN's rows round differently with the "
                         "number of rows), which did not load here: "
                         + native.missing_reason("pack_panels_f32", "linear_f32"))
