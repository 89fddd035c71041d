"""The CPU Gumbel-max sampler (gumbel.c) for rollout.sample.sampler: the tokens of the torch
noise path, bit for bit, at a fraction of its cost.

Bit-identity rests on two facts `_kernel` establishes once per process, over every uniform the
noise can draw (2^23 of them): torch's CPU `log` gives the bits of MKL's vmsLn (looked up in
libtorch_cpu, called by gumbel.c for the few tokens that need the exact noise), and the kernel's
fast approximation of the noise is within the bound it then uses. A torch without MKL, or whose
`log` is another routine, or a CPU without AVX2, keeps the torch path.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from functools import cache

import torch

from . import fp32_cpu, has, library
from .ops import operator

# What torch passes to vmsLn (aten/src/ATen/cpu/vml.h): VML_HA | VML_FTZDAZ_OFF |
# VML_ERRMODE_IGNORE.
_VML_MODE = 0x2 | 0x140000 | 0x100


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and _kernel() is not None


@operator("gumbel_argmax(Tensor candidates, Tensor keys) -> Tensor",
          lambda candidates, keys: candidates.new_empty(candidates.shape[0], dtype=torch.long))
def gumbel_argmax(candidates: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax(candidates + the counter noise of each row's key) per row, int64 [B]:
    `candidates` [B, V] fp32 with unit stride along V, `keys` int32 [B] (rollout.sample.noise
    row_keys of the row's seed, position and stream)."""
    # V 0: the C's row scan has no first candidate (a zero-length array; torch's argmax raises)
    if not (candidates.dim() == 2 and candidates.stride(-1) == 1 and fp32_cpu(candidates)
            and candidates.shape[1] >= 1 and keys.dtype == torch.int32
            and keys.numel() == candidates.shape[0]):
        raise ValueError(f"gumbel_argmax: candidates {candidates.dtype} "
                         f"{tuple(candidates.shape)} must be fp32 [B, V >= 1] on the CPU (unit "
                         f"stride along V), keys {keys.dtype} {tuple(keys.shape)} int32 [B]")
    rows, vocab = candidates.shape
    keys = keys.contiguous()
    tokens = torch.empty(rows, dtype=torch.long)
    fn, vlog, bound = _kernel()
    fn(candidates.data_ptr(), rows, vocab, candidates.stride(0), keys.data_ptr(), bound,
       tokens.data_ptr(), vlog, _VML_MODE, torch.get_num_threads())
    return tokens


@cache
def _kernel():
    lib = library()
    vlog = _torch_vlog()
    if not has("gumbel_argmax_f32", "gumbel_all_uniforms") or vlog is None:
        return None
    fn = lib.gumbel_argmax_f32
    bound = _noise_bound(lib, vlog)
    if bound is None:
        warnings.warn("rollout_kernels.cpu: torch's CPU log is not MKL's vmsLn here; sampling "
                      "noise runs on torch ops", stacklevel=2)
        return None
    return fn, vlog, bound


def _noise_bound(lib, vlog) -> float | None:
    """max |approximate - exact noise| over every uniform, once the exact noise is checked to
    be torch's (None if not). Once per process: 2^23 uniforms."""
    n = 1 << 23
    approx, exact = torch.empty(n), torch.empty(n)
    lib.gumbel_all_uniforms(approx.data_ptr(), exact.data_ptr(), vlog, _VML_MODE)
    u = (torch.arange(n, dtype=torch.int32).to(torch.float32) + 0.5) * (1.0 / n)
    if not torch.equal(exact, u.log_().neg_().log_().neg_()):  # counter_noise's own ops
        return None
    return (approx.double() - exact.double()).abs().max().item()


def _torch_vlog() -> int | None:
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.cast(ctypes.CDLL(path).vmsLn, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
