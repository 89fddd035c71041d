"""The Triton kernels compiled for a Hopper GPU on this machine, GPU or not: their launches as
the wrappers make them on CUDA (the batch-invariant mode's projections, norms, row sums, MoE
and LoRA; the sampler's and the noise's libdevice branch, which the interpreter never takes;
paged attention in its modes and head sizes, the shared-prefix path, merges, the K/V store,
draft acceptance), specialised as the JIT specialises them on CUDA, through Triton's
pipeline to ptxas's cubin, within a Hopper SM's shared memory (tests/support/gpu_compile.py,
~1 min). Whether the compiled kernels compute the right rows is their tests' on a GPU."""

import os
import pathlib
import subprocess
import sys

import pytest
import triton

SCRIPT = pathlib.Path(__file__).parents[1] / "support" / "gpu_compile.py"
PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build ships no ptxas")
def test_kernels_compile_for_hopper(tmp_path):
    # A process of its own: TRITON_INTERPRET (set by conftest.py without a GPU) decides when a
    # kernel is decorated whether it compiles at all; a cache of its own, cold every run.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    # (the script fails itself where a kernel of rollout_kernels.triton had no launch)
    assert len({line.split()[1] for line in lines if line.startswith("ok ")}) >= 14, lines
