"""The Triton kernels compiled for a Hopper GPU on this machine, GPU or not: their launches as
the wrappers make them on CUDA (the batch-invariant mode's projections, norms, row sums, MoE
and LoRA; the sampler's and the noise's libdevice branch, which the interpreter never takes;
paged attention in its modes and head sizes, the shared-prefix path, merges, the K/V store,
draft acceptance), through Triton's pipeline to ptxas's cubin (tests/support/
gpu_compile.py, ~50 s). What only compiled code meets fails here, not in a GPU session;
whether the compiled kernels compute the right rows is their tests' on a GPU."""

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
    compiled = {line.split()[1] for line in lines if line.startswith("ok ")}
    assert compiled == KERNELS, lines


KERNELS = {"_linear_kernel", "_rms_norm_kernel", "_row_sum_kernel", "_gate_up_kernel",
           "_down_kernel", "_shrink_kernel", "_expand_kernel", "_sample_kernel", "_noise_kernel",
           "_paged_attention_kernel", "_merge_states_kernel", "_store_kv_kernel",
           "_accept_drafts_kernel"}
