"""Native CPU kernels: C sources beside this file, compiled at first use with the machine's C
compiler (`cc`, or $CC) for this CPU, cached, and loaded with ctypes.

Torch's CPU ops leave a decode step to gathers, padded tiles and many small ops:
paged_attention.c reads the KV pool in place, linear.c multiplies by weights packed in panels,
norm_rope.c does RMSNorm and rotary in one pass each, silu_mul.c the gated MLP's activation,
gumbel.c draws the sampler's tokens. Plain C with no torch headers, so the build needs only
a C compiler.
OpenMP: the library asks for `libgomp.so.1`, which the loader resolves to the one torch
already loaded, so both share one thread pool (two runtimes would each keep threads spinning on
the same cores).

No compiler, or a build that fails, leaves `library()` None (said once in a warning): the
torch paths run instead. ROLLOUT_NATIVE=0 turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

from ..cache import cache_root

SOURCES = ("paged_attention.c", "gumbel.c", "norm_rope.c", "silu_mul.c", "linear.c")
HEADERS = ("exp_approx.h",)  # not compiled on their own; part of the build's key
_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# Every entry point's argument and result types, set once when the library loads: without them
# ctypes passes Python ints as C ints, truncating 64-bit pointers and sizes.
SIGNATURES = {
    "paged_attention_f32": ([_P, _I64, *[_P] * 11, _I64, _I64, _I64, _I64, _F32, _I64, _F32,
                             _P, _I64, _P, _I64, _P, _I64, _I64, _INT], _I64),
    "plan_chunks": ([_P, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P], _I64),
    "gumbel_argmax_f32": ([_P, _I64, _I64, _I64, _P, _F32, _P, _P, _I64, _INT], None),
    "gumbel_all_uniforms": ([_P, _P, _P, _I64], None),
    "gumbel_supported": ([], _INT),
    "rms_norm_f32": ([_P, _I64, _P, _P, _I64, _I64, _F32, _INT], None),
    "add_rms_norm_f32": ([_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _F32, _INT], None),
    "rotary_f32": ([_P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _I64, _I64, _INT], None),
    "silu_mul_f32": ([_P, _I64, _P, _I64, _P, _I64, _I64, _INT], None),
    "pack_panels_f32": ([_P, _I64, _I64, _P, _INT], None),
    "linear_f32": ([_P, _I64, _I64, _I64, _P, _I64, _P, _INT], None),
    "linear_supported": ([], _INT),
}
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
         "-shared", "-fPIC")
# x86: the compiler's auto-vectorised loops (norm sums, rotary, silu, the softmax) stay 256 bits
# wide on AVX-512 machines too, so they add in the same lane order and round as on AVX2 ones: with
# 512-bit lanes a LoRA-trained tiny Llama's logprob gap to transformers rose from 5.7e-6 to
# 1.05e-5 (AMD EPYC, GCC 12). No kernel here has a measured AVX-512 variant yet.
X86_FLAGS = ("-mprefer-vector-width=256",)


def build_flags() -> tuple[str, ...]:
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    return FLAGS + (X86_FLAGS if x86 else ())


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., dim] as [rows, dim] with unit stride within a row, what the kernels take (a row
    pointer and a row stride): a view where one exists, else a contiguous copy."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def cache_dir() -> Path:
    return cache_root() / "native"


@cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("ROLLOUT_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("rollout_kernels.cpu: no C compiler found; the CPU kernels' torch paths run",
                      stacklevel=2)
        return None
    here = Path(__file__).parent
    sources = [here / name for name in SOURCES]
    try:
        lib = ctypes.CDLL(str(_build(compiler, sources, [here / name for name in HEADERS])))
        for name, (argtypes, restype) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        return lib
    except (OSError, AttributeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or e
        warnings.warn(f"rollout_kernels.cpu: building the CPU kernels failed ({detail}); their "
                      f"torch paths run", stacklevel=2)
        return None


def _build(compiler: str, sources: list[Path], headers: list[Path]) -> Path:
    # -march=native code is for this CPU only: the key holds the CPU's flags as well.
    key = hashlib.sha256()
    for part in (compiler, *build_flags(), _cpu_flags(), *(f.read_bytes() for f in (*sources, *headers))):
        key.update(part if isinstance(part, bytes) else part.encode())
    target = cache_dir() / f"rollout_native_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes building at once never load half a
    # file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *build_flags(), *map(str, sources), "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
