"""CPU projections on weights packed in panels for linear.c (fp32): on a 2-core AVX2 machine
SmolLM2-135M's 120 projections take 26 ms at 16 rows against 40 ms on oneDNN's packed layout,
and 150 against 188 ms at 128 rows (bench/decode_step.py's matmul floor moves with them).
`NativePackedWeight` has PackedWeight's interface (rollout/models/layers/packed_linear.py: a
copy derived from the weight, made again whenever the weight's storage or version changes,
dropped at sleep). Beyond MAX_ROWS rows (a long prefill chunk) the panels would be read too
many times; those take F.linear on the weight itself."""

from __future__ import annotations

from functools import cache

import torch
from torch.nn import functional as F

from . import library

MAX_ROWS = 2048  # at 2048 rows the panels and F.linear (MKL) run level
PANEL = 16  # output columns a panel holds (linear.c)


@cache
def supported() -> bool:
    lib = library()
    return lib is not None and lib.linear_supported() == 1


class NativePackedWeight:
    """The panel-packed copy of one fp32 [out, in] CPU weight and the (storage, version) it was
    made from."""

    __slots__ = ("packed", "key")

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.key: tuple | None = None

    def refresh(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version)
        if key != self.key:
            self.drop()
            n, k = weight.shape
            w = weight.detach().contiguous()
            self.packed = torch.empty(-(-n // PANEL) * PANEL * k, dtype=torch.float32)
            library().pack_panels_f32(w.data_ptr(), n, k, self.packed.data_ptr(),
                                      torch.get_num_threads())
            self.key = key
        return self.packed

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        n, k = weight.shape
        rows = x.reshape(-1, k)
        if rows.shape[0] > MAX_ROWS or x.dtype != torch.float32:
            return F.linear(x, weight, bias)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        packed = self.refresh(weight)
        y = torch.empty(rows.shape[0], n, dtype=torch.float32)
        if rows.shape[0]:
            library().linear_f32(rows.data_ptr(), rows.stride(0), rows.shape[0], k,
                                 packed.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
        if bias is not None:
            y.add_(bias)
        return y.view(*x.shape[:-1], n)

    def drop(self) -> None:
        self.packed = self.key = None

    @property
    def nbytes(self) -> int:
        return 0 if self.packed is None else self.packed.numel() * 4
