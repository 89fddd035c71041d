"""update_weights' verified copy on the CPU in one pass (checked_copy.c): dst = src with both
sides' bit sums (checksum.bit_sum's) and dst's finiteness, the checks read from the cache
while the block just copied is still there, instead of three more passes over memory."""

from __future__ import annotations

import torch

from . import has, library
from .ops import operator

# Each float dtype's exponent bits: all ones is an inf or a nan.
EXPONENT = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def supported(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether this copy can take the kernel: CPU tensors of one float dtype and shape, both
    contiguous and 4-byte aligned."""
    return (dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.dtype in EXPONENT and dst.shape == src.shape and dst.is_contiguous()
            and src.is_contiguous() and dst.data_ptr() % 4 == 0 and src.data_ptr() % 4 == 0
            and has("checked_copy"))


@operator("checked_copy(Tensor(a!) dst, Tensor src) -> Tensor",
          lambda dst, src: dst.new_empty(3, dtype=torch.int32))
def copy_with_sums(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src); int32 [3]: src's bit sum, dst's bit sum after the copy, and 1 where dst
    holds a value that is not finite."""
    sums = torch.zeros(3, dtype=torch.int32)
    at = sums.data_ptr()
    library().checked_copy(src.data_ptr(), dst.data_ptr(), dst.numel() * dst.element_size(),
                           dst.element_size(), EXPONENT[dst.dtype], at, at + 4, at + 8,
                           torch.get_num_threads())
    # A write torch did not see: bump dst's version as copy_ would, so what is derived from
    # the weight (packed copies, packed_linear.weight_key) is made again.
    torch.autograd.graph.increment_version(dst)
    return sums


def checked_copy(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, bool]:
    """dst.copy_(src); (src's bit sum, dst's bit sum after the copy, dst all finite)."""
    source, copied, not_finite = copy_with_sums(dst, src).tolist()
    return source, copied, not not_finite
