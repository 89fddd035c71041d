"""The experts of one MoE layer: the engine's torch path (moe_torch, one matmul pair per expert
any token chose) against a naive loop over (token, choice) pairs; on the CPU the same path
multiplying by the cpu backend's packed copies (the panels, as the engine runs it) against
F.linear; on CUDA only, the fused Triton kernel (kernels/triton/fused_moe.py; the
interpreter would time Python, not the kernel).
Ratios of best-of-N wall times, measured in the same run. On CUDA also the kernel's TFLOP/s
(6 T k H I: gate-up, then down) against torch.matmul's on the same active-parameter shapes
(x [T, H] times the k experts' gate-up weights as one [H, 2kI], then [T, kI] x [kI, H]): the
limit a grouped GEMM approaches, which reads at least those k experts' weights. Nothing
asserted; not run in CI.

Default shape: one layer of Qwen3-30B-A3B (hidden 2048, expert size 768, top-8 of 128) on
CUDA, a quarter of it on the CPU (hidden 1024, expert size 384, top-8 of 32).

    python bench/moe.py --threads 1                      # CPU, fp32, ~1 minute
    python bench/moe.py --dtype bfloat16 --tokens 1,64,512,4096   # CUDA
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rollout.models.layers.expert_packing import PackedExperts  # noqa: E402
from rollout.models.layers.moe import moe_torch  # noqa: E402
from rollout.models.layers.packed_linear import Projection, packing_for  # noqa: E402
from rollout.ops.backend import resolve_backend  # noqa: E402

FULL = dict(hidden=2048, inter=768, experts=128, top_k=8)
QUARTER = dict(hidden=1024, inter=384, experts=32, top_k=8)


def naive(x, w_gate_up, w_down, topk_weights, topk_ids, activation="silu"):
    """One (token, choice) pair at a time: the loop moe_torch replaces."""
    out = torch.zeros_like(x)
    inter = w_down.shape[2]
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w_gate_up[e] @ x[t]
            h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += (w_down[e] @ h) * topk_weights[t, j].to(x.dtype)
    return out


def best_of(fn: Callable[[], object], repeats: int, device: str) -> float:
    fn()  # warm-up (Triton compiles here)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--naive-max-tokens", type=int, default=256,
                    help="skip the naive loop above this many tokens (it is slow)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = FULL if device == "cuda" else QUARTER
    dtype = getattr(torch, args.dtype)
    hidden, inter, num_experts, top_k = (shape[k] for k in ("hidden", "inter", "experts",
                                                             "top_k"))
    gen = torch.Generator().manual_seed(0)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen)
                 / hidden ** 0.5).to(device, dtype)
    w_down = (torch.randn(num_experts, hidden, inter, generator=gen)
              / inter ** 0.5).to(device, dtype)
    print(f"{device}, {torch.get_num_threads()} threads, {args.dtype}, hidden {hidden}, "
          f"expert size {inter}, top-{top_k} of {num_experts}, best of {args.repeats}")
    if device == "cuda":
        from rollout_kernels.triton.fused_moe import fused_moe

        # k experts' weights as the dense layer of the limit: gate-up [H, 2kI], down [kI, H].
        dense_gate_up = w_gate_up[:top_k].reshape(top_k * 2 * inter, hidden).T
        dense_down = w_down[:top_k].permute(1, 0, 2).reshape(hidden, top_k * inter).T
    else:  # the cpu backend's copies of every expert (the router's is not timed here)
        backend = resolve_backend("cpu", torch.device(device))
        packed = PackedExperts(num_experts,
                               lambda: packing_for(backend, dtype, Projection.implementations))
        packed.pack(torch.zeros(num_experts, hidden, dtype=dtype), w_gate_up, w_down)
    for num_tokens in map(int, args.tokens.split(",")):
        x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
        logits = torch.randn(num_tokens, num_experts, generator=gen).to(device)
        weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        call = (x, w_gate_up, w_down, weights, ids)
        ref = moe_torch(*call)
        t_torch = best_of(lambda: moe_torch(*call), args.repeats, device)
        line = f"T={num_tokens:5d}  torch {t_torch * 1e3:8.2f} ms"
        if num_tokens <= args.naive_max_tokens:
            err = (naive(*call).float() - ref.float()).abs().max().item()
            t_naive = best_of(lambda: naive(*call), args.repeats, device)
            line += f"  naive/torch {t_naive / t_torch:6.1f}x (max err {err:.1e})"
        if device == "cpu":
            err = (moe_torch(*call, packed=packed).float() - ref.float()).abs().max().item()
            t_packed = best_of(lambda: moe_torch(*call, packed=packed), args.repeats, device)
            line += f"  torch/packed {t_torch / t_packed:5.2f}x (max err {err:.1e})"
        if device == "cuda":
            err = (fused_moe(*call).float() - ref.float()).abs().max().item()
            t_kernel = best_of(lambda: fused_moe(*call), args.repeats, device)
            h = torch.randn(num_tokens, top_k * inter, device=device, dtype=dtype)
            t_dense = best_of(lambda: (torch.matmul(x, dense_gate_up),
                                       torch.matmul(h, dense_down)), args.repeats, device)
            tflop = 6 * num_tokens * top_k * hidden * inter / 1e12
            line += (f"  torch/triton {t_torch / t_kernel:6.1f}x (max err {err:.1e})"
                     f"  triton {tflop / t_kernel:6.1f} TFLOP/s, dense matmul "
                     f"{tflop / t_dense:6.1f} (limit ratio {t_dense / t_kernel:4.2f})")
        print(line, flush=True)


if __name__ == "__main__":
    main()
