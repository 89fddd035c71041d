"""The Triton LoRA expand at large ranks (PEFT allows any r; r=1024 adapters exist): its rank
tile is bounded (MAX_RANK_TILE) and unrolled over, so its shared memory does not grow with the
rank (a rank of 1024 needed 320 KiB, over an H200's 227 KiB per block: OutOfResources at the
first forward), and several rank tiles add the same delta as the torch reference."""

import os
import subprocess
import sys

import pytest
import torch
from floors import assert_as_exact_as
from kernels_env import DEVICE

from rollout_kernels.triton.lora import MAX_RANK_TILE, lora_add_ref, lora_expand_add, lora_shrink

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Compiled for the H200 by Triton's own compiler on this CPU (bench/kernel_resources.py), in a
# process of its own: this one runs Triton under its interpreter.
COMPILE = """
import torch
import rollout_kernels.triton.fused_moe  # (the recorder patches its launches)
from bench.kernel_resources import TARGETS, Recorder, report
from rollout_kernels.triton.lora import lora_expand_add, lora_shrink
recorder = Recorder(TARGETS["h200"])
for rank in (16, 1024):  # one block of a Llama-3-8B-wide q_proj
    x = y = torch.empty(256, 4096, dtype=torch.bfloat16)
    a, b = torch.empty(rank, 4096), torch.empty(4096, rank)
    blocks = torch.tensor([[0, 4096, 0]], dtype=torch.int32)
    recorder.case, recorder.engine = f"lora rank {rank}", True
    with recorder.launching_as_target():
        lora_expand_add(lora_shrink(x, a), b, y, blocks, torch.tensor([rank], dtype=torch.int32),
                        torch.ones(1), 4096, rank)
raise SystemExit(report("h200", recorder))
"""


def test_a_rank_of_1024_fits_an_h200s_shared_memory():
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ranks_over_several_tiles_match_the_reference(dtype):
    """A block of rank 300 (a full rank tile of MAX_RANK_TILE and a part) beside blocks of 3
    and 70, which the same launch masks within its first tile."""
    assert MAX_RANK_TILE < 300
    blocks = [(0, 40, 0, 300, 0.5), (40, 30, 300, 3, 2.0), (70, 26, 303, 70, 1.25)]
    rank, out_features, tokens = 373, 96, 5
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 72, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(rank, 72, generator=gen) * 0.1).to(DEVICE)
    b = torch.zeros(out_features, rank)
    for row, count, col, r, _ in blocks:
        b[row:row + count, col:col + r] = torch.randn(count, r, generator=gen)
    b = b.to(DEVICE)
    y = torch.randn(tokens, out_features, generator=gen).to(DEVICE, dtype)
    want, before = y.clone(), y.clone()
    lora_add_ref(x, a, b, want, blocks)
    lora_expand_add(lora_shrink(x, a), b, y,
                    torch.tensor([blk[:3] for blk in blocks], dtype=torch.int32, device=DEVICE),
                    torch.tensor([blk[3] for blk in blocks], dtype=torch.int32, device=DEVICE),
                    torch.tensor([blk[4] for blk in blocks], device=DEVICE), 40, 300)
    exact = before.cpu().double()
    shrunk = x.cpu().double() @ a.cpu().double().t()
    for row, count, col, r, scale in blocks:
        exact[:, row:row + count] += scale * shrunk[:, col:col + r] @ b.cpu().double()[
            row:row + count, col:col + r].t()
    assert_as_exact_as(y.cpu(), exact, want.cpu(), "expanded output")
