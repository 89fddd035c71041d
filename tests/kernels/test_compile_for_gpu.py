"""The batch-invariant mode's Triton kernels (kernels/triton/row_invariant.py, the invariant
fused MoE, the LoRA shrink and expand) compiled for a Hopper GPU on this machine, GPU or not:
their launches as the wrappers make them on CUDA, through Triton's pipeline to ptxas's cubin
(tests/support/gpu_compile.py). What only compiled code meets fails here, not in a GPU
session; whether the compiled kernels compute the right rows is their tests' on a GPU."""

import os
import pathlib
import subprocess
import sys

import pytest
import triton

SCRIPT = pathlib.Path(__file__).parents[1] / "support" / "gpu_compile.py"
PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build ships no ptxas")
def test_invariant_kernels_compile_for_hopper(tmp_path):
    # A process of its own: TRITON_INTERPRET (set by conftest.py without a GPU) decides when a
    # kernel is decorated whether it compiles at all; a cache of its own, cold every run.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    # linear, two norms (x 2 row counts) and the row sum a dtype, MoE's two kernels, LoRA's two
    assert sum(line.startswith("ok ") for line in lines) == 3 * (2 * 3 + 1 + 2) + 2, lines
