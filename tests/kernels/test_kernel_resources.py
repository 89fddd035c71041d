"""Every kernel variant an engine step launches compiles for an H200 (sm_90) and fits its
shared-memory limit, every Triton kernel of rollout_kernels.triton has such a launch (the
sampler's and noise's libdevice branch, the experts, LoRA and the batch-invariant mode's
kernels among them), and the launch wrappers never read device memory on the host (what a CUDA
graph capture of decode needs). Triton compiles for the GPU on this CPU: no device needed.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from bench.kernel_resources import (
    TARGETS,
    HostRead,
    Recorder,
    Variant,
    no_host_reads,
    report,
    tile_sweep_cases,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_engine_variants_compile_within_h200_limits():
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run(
        [sys.executable, "bench/kernel_resources.py", "--target", "h200",
         "--models", "llama-3-8b,qwen2-0.5b"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "HOST READ" not in run.stdout
    assert "NOT COMPILED" not in run.stdout  # every Triton kernel has a case
    variants = int(re.search(r"(\d+) variants; 0 that an engine step launches do not fit",
                             run.stdout).group(1))
    assert variants >= 20  # both models, every step kind
    for case in ("store_kv 512 tokens", "prefill 1 x 2048", "chunk 1024 + 63 decodes",
                 "decode 1 x 8192 (split-KV)", "decode 256 x 2048", "verify 8 x (4+1)",
                 "shared prefix 4 groups", "sample 64 rows", "accept rejection",
                 "noise 64 rows", "lora rank 16", "experts: prefill 2048 tokens",
                 "invariant: projection decode 256", "invariant: rms_norm (1 + w)",
                 "invariant: experts decode 64", "logprob row sums"):
        assert f"qwen2-0.5b bfloat16: {case}" in run.stdout, case
    for kernel in ("_store_kv_kernel", "_paged_attention_kernel", "_merge_states_kernel",
                   "_sample_kernel", "_accept_drafts_kernel", "_linear_kernel",
                   "_rms_norm_kernel", "_row_sum_kernel", "_pair_matmul_kernel"):
        assert kernel in run.stdout


@pytest.mark.parametrize("read", [
    lambda t: t.item(), lambda t: t.tolist(), lambda t: t.cpu(), lambda t: t.numpy(),
    lambda t: bool(t[0]), lambda t: int(t[0]), lambda t: float(t[0]), lambda t: range(t[0]),
])
def test_host_read_guard_refuses_every_read(read):
    t = torch.ones(3, dtype=torch.int32)
    with no_host_reads(), pytest.raises(HostRead):
        read(t)
    assert t.sum().item() == 3  # restored on exit


def test_report_fails_on_an_engine_variant_over_the_limit(capsys):
    h200 = TARGETS["h200"]
    recorder = Recorder.__new__(Recorder)  # report() reads only target and variants
    recorder.target = h200

    def variant(shared: int, engine: bool) -> Variant:
        return Variant(kernel="k", cases=["c"], constexprs={}, num_warps=4, num_stages=2,
                       shared=shared, regs=64, spill=0, engine=engine)

    recorder.variants = {"fits": variant(h200.smem_per_block, True),
                         "sweep only": variant(h200.smem_per_block + 1, False)}
    assert report("h200", recorder) == 0
    recorder.variants["engine"] = variant(h200.smem_per_block + 1, True)
    assert report("h200", recorder) == 1
    out = capsys.readouterr().out
    assert "OVER the shared-memory limit (the tile sweep will skip it)" in out
    assert "1 that an engine step launches do not fit" in out


def test_occupancy_follows_the_tightest_resource():
    h200 = TARGETS["h200"]
    v = Variant(kernel="k", cases=[], constexprs={}, num_warps=4, num_stages=2, shared=0,
                regs=32, spill=0, engine=True)
    assert v.resident_warps(h200) == 64  # warps limit: 16 blocks of 4
    v.regs = 128  # 4096 registers per warp: 16 warps
    assert v.resident_warps(h200) == 16
    v.regs, v.shared = 32, 100 * 1024  # two 101 KiB blocks per 228 KiB SM
    assert v.resident_warps(h200) == 8


def test_tile_sweep_cases_import_the_sweep_as_the_script_does(monkeypatch):
    # Run as a script, bench/ is sys.path[0]: `--tiles` finds bench/triton_kernels.py's sweep there.
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    from triton_kernels import TILE_SWEEP

    names = [name for name, _ in tile_sweep_cases()]
    assert names == [f"tile sweep {shape} {tile}" for shape, _, _, tiles in TILE_SWEEP
                     for tile in tiles]
