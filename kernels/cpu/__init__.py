"""Native CPU kernels: C sources beside this file, compiled at first use with the machine's C
compiler (`cc`, or $CC, split like a shell word list: `CC="ccache gcc"`) for this CPU, cached
under rollout_kernels.cache, and loaded with ctypes.

Torch's CPU ops leave a decode step to gathers, padded tiles and many small ops:
paged_attention.c reads the KV pool in place, linear.c multiplies by weights packed in panels,
norm_rope.c does RMSNorm and rotary in one pass each, silu_mul.c the gated MLP's activation,
gumbel.c draws the sampler's tokens, radix_sort.c and top_p_prefix.c sort and scan the rows
the top-p filter must sort; checked_copy.c is update_weights' verified copy. Plain C with no
torch headers, so the build needs only a C compiler. OpenMP: the library asks for
`libgomp.so.1`, which the loader resolves to the one torch already loaded, so both share one
thread pool (two runtimes would each keep threads spinning on the same cores); clang is told to
use it too (`-fopenmp=libgomp`).

The same numbers on every x86 machine: auto-vectorised loops stay 256 bits wide on AVX-512
hosts (X86_FLAGS), and files whose results are bit-exact against torch are compiled without
floating-point contraction (FILE_FLAGS), whatever the compiler's default. Kernels written with
AVX2/FMA intrinsics have portable C paths, except the Gumbel sampler and the packed linear,
which a CPU without both leaves out: each entry point is bound on its own, so a missing one
turns off only its kernel (`has`), and the warning says which and why.

The build is shared: one per host and key (a lock around check-and-build, so ranks starting
together build once), readable by every user, built under a temporary name that a build after
an interrupted one removes. The key holds the compiler and its version, the flags, the CPU's
features (x86 `flags`, ARM `Features`) and every source and header.

No compiler, or a build that fails, leaves `library()` None (said once in a warning): the torch
paths run instead. ROLLOUT_NATIVE=0 turns the kernels off; ROLLOUT_NATIVE_MARCH (default
`native`) builds for another -march (the portable paths: `x86-64`); ROLLOUT_NATIVE_CFLAGS adds
flags (`make sanitize` adds the sanitizers).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

from ..cache import cache_root

SOURCES = ("paged_attention.c", "gumbel.c", "norm_rope.c", "silu_mul.c", "linear.c",
           "linear_amx.c", "checked_copy.c", "radix_sort.c", "top_p_prefix.c")
# Headers: not compiled on their own, part of the build's key.
HEADERS = ("exp_approx.h", "attention_avx2.h", "attention_avx512.h")
_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# Every entry point's argument and result types, set once when the library loads: without them
# ctypes passes Python ints as C ints, truncating 64-bit pointers and sizes.
SIGNATURES = {
    "paged_attention_f32": ([_P, _I64, *[_P] * 11, _I64, _I64, _I64, _I64, _F32, _I64, _F32,
                             _P, _I64, _P, _I64, _P, _I64, _I64, _INT, _INT], _I64),
    "plan_chunks": ([_P, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P], _I64),
    "gumbel_argmax_f32": ([_P, _I64, _I64, _I64, _P, _F32, _P, _P, _I64, _INT], None),
    "gumbel_all_uniforms": ([_P, _P, _P, _I64], None),
    "rms_norm_f32": ([_P, _I64, _P, _P, _I64, _I64, _F32, _INT], None),
    "add_rms_norm_f32": ([_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _F32, _INT], None),
    "rotary_f32": ([_P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _I64, _I64, _INT], None),
    "silu_mul_f32": ([_P, _I64, _P, _I64, _P, _I64, _I64, _INT], None),
    "pack_panels_f32": ([_P, _I64, _I64, _P, _INT], None),
    "linear_f32": ([_P, _I64, _I64, _I64, _P, _I64, _P, _INT], None),
    "linear_add_f32": ([_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _F32, _INT], None),
    "linear_tuned": ([], _INT),
    "pack_panels_amx": ([_P, _I64, _I64, _I64, _I64, _P, _INT], None),
    "linear_amx_bf16": ([_P, _I64, _I64, _I64, _P, _I64, _I64, _P, _INT], _INT),
    "amx_ready": ([], _INT),
    "checked_copy": ([_P, _P, _I64, _INT, ctypes.c_uint32, _P, _P, _P, _INT], None),
    "radix_sort_u32": ([_P, _I64, _I64, _I64], _INT),
    "top_p_prefix_f32": ([_P, _I64, _I64, _I64, _I64, _P, _P, _P], None),
}
# What a CPU without AVX2 and FMA leaves out of the build (the C says so with #if).
# (linear.c builds everywhere: its portable path serves the batch-invariant mode, linear.py.)
NEEDS_AVX2_FMA = {"gumbel_argmax_f32", "gumbel_all_uniforms"}
# What only a CPU with AMX builds, a faster path whose absence costs nothing else
# (linear_amx.c: its callers take linear.c's fp32 panels), so no warning says it is missing.
NEEDS_AMX = {"linear_amx_bf16", "amx_ready"}
FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fPIC")
# x86: the compiler's auto-vectorised loops (norm sums, rotary, silu, the softmax) stay 256 bits
# wide on AVX-512 machines too, so they add in the same lane order and round as on AVX2 ones: with
# 512-bit lanes a LoRA-trained tiny Llama's logprob gap to transformers rose from 5.7e-6 to
# 1.05e-5 (AMD EPYC, GCC 12). No kernel here has a measured AVX-512 variant yet.
X86_FLAGS = ("-mprefer-vector-width=256",)
# Rotary gives torch's bits only without contraction of its multiply-adds into FMAs (clang's
# default is on, GCC's fast): the file's own flag, after the rest, so no CC or CFLAGS undo it.
FILE_FLAGS = {"norm_rope.c": ("-ffp-contract=off",)}
LOCK = ".build.lock"
PARTIAL = ".partial"  # suffix of a library being built


def fp32_cpu(*tensors: torch.Tensor) -> bool:
    """What the kernels' wrappers check before a call (with the shapes they need): handed
    another dtype or shape, the C code would read and write past its buffers (a corrupted heap,
    not an error), so each raises ValueError naming itself instead."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., dim] as [rows, dim] with unit stride within a row, what the kernels take (a row
    pointer and a row stride): a view where one exists, else a contiguous copy."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def cache_dir() -> Path:
    return cache_root() / "native"


def compiler() -> list[str] | None:
    """$CC as a word list (it may carry a launcher or arguments), else cc or gcc; None: none."""
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def build_flags(cc: list[str]) -> list[str]:
    clang = "clang" in _version(tuple(cc)).lower()
    flags = [*FLAGS, f"-march={_march()}", "-fopenmp=libgomp" if clang else "-fopenmp"]
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        flags += X86_FLAGS
    return flags + shlex.split(os.environ.get("ROLLOUT_NATIVE_CFLAGS", ""))


@cache
def library() -> ctypes.CDLL | None:
    """The built library (its `missing`: the entry points this build lacks), or None."""
    if os.environ.get("ROLLOUT_NATIVE", "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        warnings.warn("rollout_kernels.cpu: no C compiler found; the CPU kernels' torch paths "
                      "run", stacklevel=2)
        return None
    here = Path(__file__).parent
    try:
        lib = ctypes.CDLL(str(_build(cc, [here / n for n in SOURCES],
                                     [here / n for n in HEADERS])))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or e
        warnings.warn(f"rollout_kernels.cpu: building the CPU kernels failed ({detail}); their "
                      f"torch paths run", stacklevel=2)
        return None
    missing = set()
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            missing.add(name)
            continue
        fn.argtypes, fn.restype = argtypes, restype
    lib.missing = frozenset(missing)
    if missing - NEEDS_AMX:
        warnings.warn(f"rollout_kernels.cpu: {_why(missing - NEEDS_AMX)}; their torch "
                      f"paths run", stacklevel=2)
    return lib


def has(*names: str) -> bool:
    """Whether the library is built and has these entry points."""
    lib = library()  # cached itself; not cached here, so a dropped library is seen at once
    return lib is not None and not lib.missing.intersection(names)


def missing_reason(*names: str) -> str:
    """Why `has(*names)` is False, for a skip or a warning."""
    if os.environ.get("ROLLOUT_NATIVE", "1") == "0":
        return "ROLLOUT_NATIVE=0"
    lib = library()
    if lib is None:
        return "no C compiler, or the build failed (see the warning)"
    lacking = lib.missing.intersection(names)
    return _why(lacking) if lacking else "built"


def _why(missing) -> str:
    """Which entry points a build lacks, and why."""
    names = ", ".join(sorted(missing))
    if set(missing) <= NEEDS_AVX2_FMA:
        return f"{names} need AVX2 and FMA (-march={_march()})"
    if set(missing) <= NEEDS_AMX:
        return f"{names} need AMX-BF16 (-march={_march()})"
    return f"{names} not built"


def _march() -> str:
    return os.environ.get("ROLLOUT_NATIVE_MARCH", "native")


def library_path(cc: list[str], sources: list[Path], headers: list[Path]) -> Path:
    """Where the build of these sources by `cc` for this CPU lives in the cache."""
    key = hashlib.sha256()
    parts = (*cc, _version(tuple(cc)), *build_flags(cc), repr(sorted(FILE_FLAGS.items())),
             platform.machine(), _cpu_features(),
             *(f.read_bytes() for f in (*sources, *headers)))
    for part in parts:
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    return cache_dir() / f"rollout_native_{key.hexdigest()[:16]}.so"


def _build(cc: list[str], sources: list[Path], headers: list[Path]) -> Path:
    flags = build_flags(cc)
    target = library_path(cc, sources, headers)
    folder = target.parent
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # One build per host: whoever holds the lock builds; the others find the library after it.
    with open(folder / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        for stale in folder.glob(f"*{PARTIAL}"):  # a build killed before its rename
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink(missing_ok=True)
        with tempfile.TemporaryDirectory(dir=folder, suffix=PARTIAL) as objects:
            fd, tmp = tempfile.mkstemp(suffix=PARTIAL, dir=folder)
            os.close(fd)
            try:
                outputs = []
                for source in sources:
                    out = os.path.join(objects, source.stem + ".o")
                    subprocess.run([*cc, *flags, *FILE_FLAGS.get(source.name, ()), "-c",
                                    str(source), "-o", out], check=True, capture_output=True,
                                   text=True)
                    outputs.append(out)
                subprocess.run([*cc, *flags, "-shared", *outputs, "-o", tmp, "-lm"], check=True,
                               capture_output=True, text=True)
                os.chmod(tmp, 0o755)  # mkstemp makes it 0600: other users load it too
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    return target


@cache
def _version(cc: tuple[str, ...]) -> str:
    try:
        out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60)
        return out.stdout.splitlines()[0] if out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_features() -> str:
    """The CPU's feature list: `-march=native` code is for CPUs that have them all."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.readlines()
    except OSError:
        return platform.processor()
    return next((line for line in lines if line.split(":")[0].strip() in ("flags", "Features")),
                platform.processor())
