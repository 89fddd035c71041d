"""This CPU's fp32 FMA peak, measured: fma_peak.c built with -O3 -march=native (the widest
FMAs the CPU has), one timed call per measurement; a bench keeps the best of its calls."""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


class FmaPeak:
    """The probe, built once: `gflops(threads)` times one call of about `seconds`, so a bench
    can interleave it with what it measures against it (the clock moves with the load)."""

    def __init__(self, seconds: float = 0.2) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            lib_path = os.path.join(tmp, "fma_peak.so")
            cc = os.environ.get("CC", "cc").split()
            subprocess.run([*cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                            os.path.join(HERE, "fma_peak.c"), "-o", lib_path], check=True)
            self.lib = ctypes.CDLL(lib_path)
        self.lib.fma_flops.restype = ctypes.c_double
        self.lib.fma_flops.argtypes = [ctypes.c_int64, ctypes.c_int]
        self.lanes = self.lib.fma_lanes()  # 16 with AVX-512, 8 with AVX2 + FMA, 0 without
        self.seconds, self.iters = seconds, 100_000

    def gflops(self, threads: int) -> float:
        if not self.lanes:
            return float("nan")
        t0 = time.perf_counter()
        flops = self.lib.fma_flops(self.iters, threads)
        elapsed = time.perf_counter() - t0
        self.iters = max(1, int(self.iters * self.seconds / elapsed))  # next call: ~seconds
        return flops / elapsed / 1e9


def rotated(cases: list, repeat: int) -> list:
    """`cases` in the order of repeat number `repeat` of a loop that ends with the probe: each
    case in turn runs first after the probe's all-core FMAs (the clock they leave, the caches
    they flush), so that start costs every case alike and interleaving compares them."""
    k = repeat % len(cases)
    return cases[k:] + cases[:k]
