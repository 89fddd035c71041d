"""Sampling-step cost with top-k / top-p / min-p: the full-sort filter against the one in
rollout/sample/sampler.py. Not part of CI; prints only.

    python bench/sampling.py [--batch 128 8] [--vocab 49152] [--repeats 7] [--threads N]
                             [--logits normal peaked flat] [--draw]

A step is the cpu backend's `draw_cpu` (log_softmax, filter, counter-noise Gumbel-max in C,
logprob gather) on fp32 logits. "old" swaps in the previous filter (a full sort with indices,
kept below as the reference, with today's log_softmax); "new" is the current one. Old and new
alternate, best of N each.
Logits: "normal" = N(0, 1) x 3 (about 2,000 tokens cover top_p = 0.9 of a 49,152 vocab);
"peaked" = the same plus three leading tokens (top-1 probability ~0.05 to ~0.999 across
rows, an LM-like step);
--draw: instead, the cpu backend's Sampler.draw of a batch without filters (temperature 1 and
0.8): the whole batch at once (what it was) against a block of rows at a time (the same emitted
tokens and logprobs, checked), each on fresh logits as in the engine.
--alternatives: instead, the top-k alternatives (SamplingParams.top_logprobs) of a batch:
torch.topk against rollout/sample/ranked.py's order (ties by token id), k = 5 and 20.

"flat" = N(0, 1) x 0.5 (what a random-weight head gives: hidden norm ~sqrt(576) times
weights of std 0.02; top_p = 0.9 keeps most of the vocab). A "-bf16" suffix rounds them to
bfloat16, as a bf16 LM head's logits are: values tie at nearly every filter boundary.

"rows settled by": top_k (torch.topk, top-p decided on the top-k values), top_k_softmax (top-p
on the exact top-k values), candidates (top-p decided on the top CANDIDATES), sorted (the
fallback: a sort of the row's values), reference (the full sort with indices: NaN rows).
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch

from rollout.ops.backend import resolve_backend
from rollout.sample import filters as sampling_filter
from rollout.sample import sampler
from rollout.sample.log_softmax import log_softmax
from rollout.sample.ranked import top_ranked
from rollout.sample.sampler import Sampler, SamplingBatch, draw_cpu


def old_target_logprobs(logits, batch):
    """target_logprobs as it was: every row filtered by the full sort."""
    logits = logits.float()
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    logp = log_softmax(logits / temperature[:, None])
    if batch.needs_filter:
        return logp, sampling_filter.filter_by_sort(logp, batch.top_k, batch.top_p, batch.min_p)
    return logp, logp


def make_logits(kind: str, batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    if kind.endswith("-bf16"):  # a bf16 LM head's logits: on the bf16 grid, ties everywhere
        return make_logits(kind[:-5], batch, vocab, seed).bfloat16().float()
    g = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(batch, vocab, generator=g) * 0.5
    logits = torch.randn(batch, vocab, generator=g) * 3
    if kind == "peaked":
        # Three leading tokens 12..22, -0..3, -0..3 above the bulk (whose total is ~e^15.3):
        # top-1 probability from ~0.05 to ~0.999 across rows.
        lead = torch.rand(batch, 3, generator=g) * torch.tensor([10.0, -3.0, -3.0])
        lead[:, 0] += 12.0
        hot = torch.randperm(vocab, generator=g)[:3].expand(batch, 3)
        logits.scatter_add_(1, hot, lead.cumsum(dim=1))
    return logits


CASES = {
    "no filter": {},
    "top_k=50": {"top_k": 50},
    "top_p=0.9": {"top_p": 0.9},
    "top_p=0.9+top_k=50": {"top_p": 0.9, "top_k": 50},
    "min_p=0.05": {"min_p": 0.05},
}


def batch_for(rows: int, params: dict) -> SamplingBatch:
    return SamplingBatch.build([1.0] * rows, [params.get("top_k", 0)] * rows,
                               [params.get("top_p", 1.0)] * rows,
                               [params.get("min_p", 0.0)] * rows, list(range(rows)),
                               [17] * rows, "cpu")


def best_of(fns: dict, repeats: int) -> dict:
    """Best wall time (ms) of each function, calls interleaved."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def run(rows: int, vocab: int, kind: str, repeats: int) -> None:
    logits = make_logits(kind, rows, vocab)
    logp = logits.log_softmax(dim=-1)
    print(f"\nbatch {rows}, vocab {vocab}, {kind} logits, best of {repeats} (ms per step)")
    print(f"{'case':<22}{'old':>10}{'new':>10}{'old/new':>9}{'new/none':>10}   rows settled by")
    fns, shares = {}, {}
    for name, params in CASES.items():
        b = batch_for(rows, params)
        fns[(name, "new")] = lambda b=b: draw_cpu(logits, b)[:2]

        def old(b=b):
            with mock.patch.object(sampler, "target_logprobs", old_target_logprobs):
                return draw_cpu(logits, b)[:2]
        fns[(name, "old")] = old
        stats: dict[str, int] = {}
        if b.needs_filter:
            sampling_filter.filter_by_threshold(logp, b.top_k, b.top_p, b.min_p, normalized=True,
                                     stats=stats)
        shares[name] = stats
        # Same tokens and logprobs, old and new.
        assert all(torch.equal(x, y) for x, y in zip(fns[(name, "old")](), fns[(name, "new")]()))
    best = best_of(fns, repeats)
    none = best[("no filter", "new")]
    for name in CASES:
        old_ms, new_ms = best[(name, "old")], best[(name, "new")]
        settled = ", ".join(f"{key} {100 * n / rows:.0f}%" for key, n in shares[name].items()
                            if n) or "-"
        print(f"{name:<22}{old_ms:>10.1f}{new_ms:>10.1f}{old_ms / new_ms:>8.1f}x"
              f"{new_ms / none:>9.2f}x   {settled}")
    top_p = shares["top_p=0.9"]
    print(f"top_p=0.9 step / no-filter step: {best[('top_p=0.9', 'new')] / none:.2f}x "
          f"(goal <= 1.2x); top_p=0.9 rows not settled by the candidates: "
          f"{100 * top_p.get('sorted', 0) / rows:.0f}% (fallback to a sort of the values), "
          f"{100 * top_p.get('reference', 0) / rows:.0f}% (to the full sort with indices)")


def run_draw(rows: int, vocab: int, kind: str, repeats: int) -> None:
    """Each draw gets fresh logits, as each engine step's LM head makes (the allocator then
    faults pages in for the whole-batch draw's [B, V] temporaries, as in the engine)."""
    logits = make_logits(kind, rows, vocab)
    print(f"\nbatch {rows}, vocab {vocab}, {kind} logits, no filter, best of {repeats} "
          f"(ms per draw)")
    whole, blocks = (Sampler(resolve_backend("cpu", torch.device("cpu"))) for _ in range(2))
    whole._block_rows = False
    for temperature in (1.0, 0.8):
        b = SamplingBatch.build([temperature] * rows, [0] * rows, [1.0] * rows, [0.0] * rows,
                                list(range(rows)), [17] * rows, "cpu")
        paths = {"whole": lambda x: whole.draw(x, b), "blocks": lambda x: blocks.draw(x, b)}
        assert paths["whole"](logits) == paths["blocks"](logits)
        best = {name: float("inf") for name in paths}
        for _ in range(repeats):
            for name, path in paths.items():
                fresh = logits.clone()
                start = time.perf_counter()
                path(fresh)
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
                del fresh
        print(f"temperature {temperature}: whole batch {best['whole']:.1f}, in blocks "
              f"{best['blocks']:.1f} = {best['whole'] / best['blocks']:.2f}x")


def run_alternatives(rows: int, vocab: int, kind: str, repeats: int) -> None:
    logp = make_logits(kind, rows, vocab).log_softmax(dim=-1)
    print(f"\nbatch {rows}, vocab {vocab}, {kind} logits, best of {repeats} (ms)")
    for k in (5, 20):
        best = best_of({"topk": lambda: logp.topk(k, dim=-1),
                        "ranked": lambda: top_ranked(logp, k)}, repeats)
        print(f"k = {k}: torch.topk {best['topk']:.2f}, ranked {best['ranked']:.2f} = "
              f"{best['ranked'] / best['topk']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[128, 8])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default); 1 is steadier on a busy host")
    parser.add_argument("--logits", nargs="+", default=["normal", "peaked", "flat"],
                        choices=[f"{kind}{grid}" for grid in ("", "-bf16")
                                 for kind in ("normal", "peaked", "flat")])
    parser.add_argument("--draw", action="store_true",
                        help="the cpu backend's draw, whole batch vs blocks of rows")
    parser.add_argument("--alternatives", action="store_true",
                        help="top-k alternatives: torch.topk vs the ranked order")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for kind in args.logits:
        for rows in args.batch:
            bench = run_draw if args.draw else run_alternatives if args.alternatives else run
            bench(rows, args.vocab, kind, args.repeats)


if __name__ == "__main__":
    main()
