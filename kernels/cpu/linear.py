"""CPU projections on weights packed in panels for linear.c (fp32), faster than oneDNN's packed
layout at decode batch sizes (docs/benchmarks.md). The packed copy's life (made from the
weight, made again when its storage or version changes, dropped at sleep) is
NativePackedWeight's, in rollout/models/layers/packed_linear.py."""

from __future__ import annotations

import torch

from . import as_rows, fp32_cpu, has, library
from .ops import operator, returns_nothing

# Beyond this many rows (a long prefill chunk) each panel would be read against too many rows:
# there the panels and F.linear (MKL) were measured level.
MAX_ROWS = 2048
PANEL = 16  # output columns a panel holds (linear.c)


def invariant_supported(device: torch.device) -> bool:
    """linear.c runs here, on its intrinsics or its portable C (no AVX2 and FMA): each output
    element one chain over the inputs whatever the other rows, what the batch-invariant mode
    needs (linear_add too: same file)."""
    return device.type == "cpu" and has("pack_panels_f32", "linear_f32", "linear_add_f32")


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """linear.c runs here on its intrinsics (AVX2 and FMA, AVX-512), measured faster than
    oneDNN's layout: the cpu backend's default for fp32 weights. The portable C is not
    measured against oneDNN, so the default mode keeps oneDNN where only that builds."""
    return (dtype == torch.float32 and invariant_supported(device)
            and bool(library().linear_tuned()))


def add_supported(device: torch.device) -> bool:
    """linear_add runs here on the intrinsics (the default mode's LoRA deltas)."""
    return supported(device, torch.float32)


def pack_panels(weight: torch.Tensor, out: torch.Tensor | None = None,
                threads: int | None = None) -> torch.Tensor:
    """`weight` [n, k] (fp32, CPU) in panels of PANEL rows, k-major, the last padded; into
    `out` when given (of panels_numel elements), on `threads` threads (None: torch's)."""
    if not (fp32_cpu(weight) and weight.dim() == 2):
        raise ValueError(f"pack_panels: weight {weight.dtype} {tuple(weight.shape)} on "
                         f"{weight.device} must be an fp32 matrix on the CPU")
    n, k = weight.shape
    w = weight.contiguous()
    size = panels_numel(weight.shape)
    packed = torch.empty(size, dtype=torch.float32) if out is None else out
    # The C writes `size` values from out's first: a view with gaps would get them past its end.
    if not (packed.numel() == size and fp32_cpu(packed) and packed.is_contiguous()):
        raise ValueError(f"pack_panels: out holds {packed.numel()} {packed.dtype} on "
                         f"{packed.device}, needs {size} float32 on the CPU, contiguous")
    library().pack_panels_f32(w.data_ptr(), n, k, packed.data_ptr(),
                              threads or torch.get_num_threads())
    return packed


def panels_numel(shape) -> int:
    n, k = shape
    return -(-n // PANEL) * PANEL * k


def _check_packed(name: str, x: torch.Tensor, packed: torch.Tensor, n: int) -> None:
    """x of the packed weight's in-features (its panels hold n rows of k each)."""
    if not (fp32_cpu(x, packed) and packed.numel() == panels_numel((n, x.shape[-1]))
            and packed.is_contiguous()):
        raise ValueError(f"{name}: x {x.dtype} {tuple(x.shape)} must be fp32 on the CPU with "
                         f"the in-features of the packed [{n}, k] weight ({packed.numel()} "
                         f"packed values {packed.dtype}, contiguous: the C reads them in a run)")


@operator("linear(Tensor x, Tensor packed, int n) -> Tensor",
          lambda x, packed, n: x.new_empty(*x.shape[:-1], n))
def linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., k] (fp32, CPU) times the packed [n, k] weight's transpose: [..., n], new."""
    k = x.shape[-1]
    _check_packed("linear", x, packed, n)
    rows = as_rows(x)
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    if rows.shape[0]:
        library().linear_f32(rows.data_ptr(), rows.stride(0), rows.shape[0], k,
                             packed.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
    return y.view(*x.shape[:-1], n)


@operator("linear_add(Tensor x, Tensor packed, Tensor(a!) y, float alpha) -> ()",
          returns_nothing)
def linear_add(x: torch.Tensor, packed: torch.Tensor, y: torch.Tensor, alpha: float) -> None:
    """y [m, n] (unit stride within a row; a column slice of a wider output is fine) +=
    alpha * x [m, k] times the packed [n, k] weight's transpose, in place."""
    rows = as_rows(x)
    m, n = y.shape
    if y.stride(1) != 1 or rows.shape[0] != m or not fp32_cpu(y):
        raise ValueError(f"linear_add: y {tuple(y.shape)} strides {y.stride()} {y.dtype} on "
                         f"{y.device} does not fit x {tuple(rows.shape)} (fp32 on the CPU)")
    _check_packed("linear_add", x, packed, n)
    if m:
        library().linear_add_f32(rows.data_ptr(), rows.stride(0), m, rows.shape[1],
                                 packed.data_ptr(), n, y.data_ptr(), y.stride(0), alpha,
                                 torch.get_num_threads())
