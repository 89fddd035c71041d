"""RMSNorm and rotary embedding in C (norm_rope.c) for the model layers on the CPU in fp32:
one pass each instead of six to eight small torch ops. Rotary gives the torch path's bits;
RMSNorm sums its squares in another order (a float32 rounding apart)."""

from __future__ import annotations

import torch

from . import as_rows, fp32_cpu, has, library
from .ops import operator, returns_nothing


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and has("rms_norm_f32", "add_rms_norm_f32", "rotary_f32"))


@operator("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
          lambda x, weight, eps: x.new_empty(x.shape))
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * weight, a new tensor of x's shape."""
    _check_norm("rms_norm", x, x, weight)
    rows = as_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype)
    library().rms_norm_f32(rows.data_ptr(), rows.stride(0), weight.contiguous().data_ptr(),
                           out.data_ptr(), *rows.shape, eps, torch.get_num_threads())
    return out


@operator("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)",
          lambda x, delta, weight, eps: (x.new_empty(x.shape), x.new_empty(x.shape)))
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) in one pass, both new tensors of x's shape."""
    _check_norm("add_rms_norm", x, delta, weight)
    rows, deltas = as_rows(x), as_rows(delta)
    total, out = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    library().add_rms_norm_f32(rows.data_ptr(), rows.stride(0), deltas.data_ptr(),
                               deltas.stride(0), weight.contiguous().data_ptr(),
                               total.data_ptr(), out.data_ptr(), *rows.shape, eps,
                               torch.get_num_threads())
    return total, out


def _check_norm(name: str, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> None:
    if not (fp32_cpu(x, delta, weight) and delta.shape == x.shape
            and weight.shape == x.shape[-1:]):
        raise ValueError(f"{name}: x {x.dtype} {tuple(x.shape)}, delta {delta.dtype} "
                         f"{tuple(delta.shape)} and weight {weight.dtype} {tuple(weight.shape)} "
                         f"must be fp32 on the CPU, the weight of x's last dimension")


@operator("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()", returns_nothing)
def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] (heads contiguous, any token stride) in place by
    cos/sin [T, 1, rot] (contiguous, rot <= D and even)."""
    t, _, d = q.shape
    # An odd rot: the C rotates rot // 2 pairs and leaves the last dimension, which the torch
    # path's halves rotate (no model has one; refused rather than computed apart).
    if not (fp32_cpu(q, k, cos, sin) and k.shape[::2] == (t, d)
            and all(x.stride(2) == 1 and x.stride(1) == d for x in (q, k))
            and cos.shape == sin.shape and cos.shape[:2] == (t, 1) and cos.shape[2] <= d
            and cos.shape[2] % 2 == 0 and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rotary_: q {q.dtype} {tuple(q.shape)}, k {k.dtype} "
                         f"{tuple(k.shape)} (heads contiguous) and cos/sin {cos.dtype} "
                         f"{tuple(cos.shape)} [T, 1, even <= D] (contiguous) must be fp32 on the "
                         f"CPU")
    library().rotary_f32(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0),
                         k.shape[1], q.shape[2], cos.data_ptr(), sin.data_ptr(), q.shape[0],
                         cos.shape[-1], torch.get_num_threads())
