"""The CPU attention kernel (kernels/cpu/paged_attention.c) alone on a decode step's shapes:
16 prompts x n = 8 samples, each context a shared 262-token prompt and a private suffix, one KV
pool per layer as the engine has them (one buffer, on huge pages), each sample's suffix slots in
runs of --run consecutive slots, the samples' runs taking turns (KVManager.alloc_decodes'
arrangement; --run 1: token t of sample b at slot prefix + t * batch + b, the worst case).
Times a step's 30 layers with the suffixes (whole) and without them (the prompt part alone: one
key each), best of --repeat, interleaved (each in turn first after the FMA probe); prints the
prompt part's FMA rate against the CPU's FMA peak (fma_peak.c, measured in the same loop) and
the rate at which the suffixes' K/V are read. Prints only; not in CI.

    python bench/attention_kernel.py [--threads 2] [--suffix 66] [--run 32] [--repeat 15]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fma_peak import FmaPeak, rotated  # noqa: E402
from workloads import cpu_name  # noqa: E402

from rollout.kv import huge_pages  # noqa: E402
from rollout_kernels.cpu import paged_attention as native  # noqa: E402


def rows_for(prompts: int, n: int, prefix: int, suffix: int, run: int) -> native.NativeRows:
    batch = prompts * n
    slots, starts = [], []
    for b in range(batch):
        starts.append(len(slots))
        slots += list(range(prefix)) + [prefix + (t // run * batch + b) * run + t % run
                                         for t in range(suffix)]
    return native.NativeRows.of(list(range(batch)), list(range(batch)), [1] * batch, starts,
                                [prefix + suffix] * batch, torch.tensor(slots))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=262)
    ap.add_argument("--suffix", type=int, default=66, help="private tokens, the new one included")
    ap.add_argument("--run", type=int, default=32,
                    help="a sample's consecutive suffix slots (1: interleaved)")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native.supported(torch.device("cpu"), torch.float32):
        sys.exit("no C compiler: the kernel is not built")
    q_heads, kv_heads, dim = 9, 3, 64  # SmolLM2-135M
    batch = args.prompts * args.n
    num_slots = args.prefix + -(-args.suffix // args.run) * args.run * batch
    gen = torch.Generator().manual_seed(0)
    # one buffer on huge pages, as the engine's KVPool holds them
    buffer = huge_pages.empty_zeros((2, args.layers, num_slots, kv_heads, dim), torch.float32,
                                    torch.device("cpu")).normal_(generator=gen)
    pools = [(buffer[0, layer], buffer[1, layer]) for layer in range(args.layers)]
    q = torch.randn(batch, q_heads, dim, generator=gen)
    out = torch.empty_like(q)
    cases = {"prompt part": rows_for(args.prompts, args.n, args.prefix, 1, args.run),
             "whole": rows_for(args.prompts, args.n, args.prefix, args.suffix, args.run)}
    best = dict.fromkeys(cases, float("inf"))
    probe, peak = FmaPeak(), 0.0
    for i in range(args.repeat):
        for name in rotated(list(cases), i):
            t0 = time.perf_counter()
            for k, v in pools:
                native.paged_attention(q, k, v, out, cases[name], dim ** -0.5, None, None)
            best[name] = min(best[name], time.perf_counter() - t0)
        peak = max(peak, probe.gflops(torch.get_num_threads()))
    # the prompt part: every query head's scores and values over the prefix, 2 FMAs a key-dim
    flops = 4 * batch * q_heads * args.prefix * dim * args.layers
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {batch} samples "
          f"({args.prompts} prompts x n={args.n}), prefix {args.prefix}, suffix {args.suffix}, "
          f"{args.layers} layers, runs of {args.run} slots, best of {args.repeat}")
    for name, seconds in best.items():
        print(f"  {name:12} {seconds * 1e3:7.1f} ms a step")
    rate = flops / best['prompt part'] / 1e9
    print(f"  prompt part: {rate:.0f} GFLOP/s, {rate / peak:.0%} of the FMA peak ({peak:.0f} "
          f"GFLOP/s on {torch.get_num_threads()} threads, {probe.lanes}-lane FMAs; {cpu_name()})")
    # the suffixes' keys beyond the prompt part's one: each read once, K and V, every KV head
    suffix_bytes = 2 * batch * (args.suffix - 1) * kv_heads * dim * 4 * args.layers
    print(f"  suffixes: {suffix_bytes / 1e9:.2f} GB of K/V read at "
          f"{suffix_bytes / (best['whole'] - best['prompt part']) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
