"""Triton kernel benchmark (GPU only): every number is a ratio against a limit measured in the
same run on the same device.

  decode      Llama-3-8B heads (32 q / 8 kv, head dim 128, bf16), batch 1/16/128/256 x context
              1K/8K/32K: KV bytes read per second as a share of a device-to-device copy
              (copy bandwidth = (read + write bytes) / time of `dst.copy_(src)` on 4 GiB).
              Slots are either scattered (a random permutation of the pool, as after the radix
              cache has churned) or contiguous.
  prefill     causal prefill and extend over a cached prefix: attention TFLOP/s (causal FLOPs
              only) as a share of a bf16 8192^3 torch matmul.
  tiles       a short sweep of (BLOCK_N, num_warps, num_stages) for one decode and one prefill
              shape, to retune `_tile_config`.
  shared      n = 8 samples x 16 prompts (GRPO-shaped) decoding over a 1K and a 4K shared
              prompt with 256 generated tokens: KV bytes read by plain paged decode and by the
              shared-prefix path, at the last step and over the whole generation, and their
              times at the last step.
  sample      the Triton sampler against the torch sampler at batch 128, vocab 128256.

    python bench/triton_kernels.py          # ~1-2 minutes on an H200
    python bench/triton_kernels.py --smoke  # every section with tiny shapes, on any machine (the
                                     # Triton interpreter on a CPU): checks that the script
                                     # runs before GPU time is spent on it; measures nothing
"""

# No `from __future__ import annotations`: with string annotations @dataclass looks this module
# up in sys.modules, where a loader of the file by path (importlib) may not have put it.
import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# The GPU run's model shape, Llama-3-8B attention.
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16

# (name, q_lens, kv_lens, tiles), tiles = (BLOCK_N, num_warps, num_stages): the tile sweep of a
# GPU run, one decode and one prefill shape.
TILE_SWEEP = (
    ("decode 128 x 8K", (1,) * 128, (8192,) * 128,
     ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3))),
    ("prefill 4 x 4096", (4096,) * 4, (4096,) * 4,
     ((32, 8, 2), (64, 8, 2), (64, 8, 3), (128, 8, 2), (64, 4, 2))),
)


@dataclass(frozen=True)
class Shapes:
    """The model shape and the case tables every section is sized by."""

    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    copy_numel: int  # elements of the copy that sets the bandwidth limit
    matmul_n: int  # n of the n x n x n matmul that sets the FLOP/s limit
    pool_slots: int  # at most; a GPU pool is also capped by free memory
    check_cases: tuple  # (q_lens, kv_lens, num_kv_splits) checked against the torch reference
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    contiguous_batches: tuple[int, ...]  # decode batches also timed with contiguous slots
    split_off_contexts: tuple[int, ...]  # batch-1 decode timed again with split-KV forced off
    prefill_cases: tuple  # (name, q_lens, kv_lens)
    tile_sweep: tuple  # as TILE_SWEEP
    shared_groups: int
    shared_n: int  # samples per group
    shared_prompts: tuple[int, ...]
    shared_generated: int
    sampler_batch: int
    sampler_vocab: int

    @property
    def kv_token_bytes(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype.itemsize  # K and V

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]


GPU = Shapes(
    q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=DTYPE,
    copy_numel=2 << 30, matmul_n=8192,
    pool_slots=256 * 32768,  # the largest decode case
    check_cases=(((1,) * 16, tuple(1000 + 7 * i for i in range(16)), None),
                 ((1,) * 2, (3000, 20), 8), ((300, 77), (812, 77), None)),
    decode_batches=(1, 16, 128, 256), decode_contexts=(1024, 8192, 32768),
    contiguous_batches=(1, 128), split_off_contexts=(8192, 32768),
    prefill_cases=(("prefill 4 x 4096", (4096,) * 4, (4096,) * 4),
                   ("prefill 1 x 16384", (16384,), (16384,)),
                   ("extend 4 x 1024 over 7168", (1024,) * 4, (8192,) * 4),
                   ("extend 8 x 512 over 3584", (512,) * 8, (4096,) * 8)),
    tile_sweep=TILE_SWEEP,
    shared_groups=16, shared_n=8, shared_prompts=(1024, 4096), shared_generated=256,
    sampler_batch=128, sampler_vocab=128256,
)

# fp16, not bf16: the interpreter's bf16 tl.dot is wrong. Contexts of a few dozen tokens still
# span several of the interpreter's 16-wide tiles, and the sweep has tiles wider than them.
SMOKE = Shapes(
    q_heads=4, kv_heads=2, head_dim=32, dtype=torch.float16,
    copy_numel=1 << 16, matmul_n=64, pool_slots=256,
    check_cases=(((1,) * 3, (20, 27, 34), None), ((1,) * 2, (60, 5), 8),
                 ((13, 7), (40, 7), None)),
    decode_batches=(1, 3, 8), decode_contexts=(24, 40),  # 8 x 40 > pool: the skip line
    contiguous_batches=(1,), split_off_contexts=(40,),
    prefill_cases=(("prefill 1 x 24", (24,), (24,)),
                   ("extend 2 x 8 over 16", (8,) * 2, (24,) * 2)),
    tile_sweep=(("decode 2 x 40", (1,) * 2, (40,) * 2, ((16, 4, 2), (64, 4, 2))),
                ("prefill 1 x 24", (24,), (24,), ((16, 4, 2), (32, 8, 3)))),
    shared_groups=2, shared_n=2, shared_prompts=(24,), shared_generated=4,
    sampler_batch=2, sampler_vocab=1000,
)


def bench_ms(fn) -> float:
    if DEVICE == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50)
    runs = 2  # do_bench needs CUDA; off it the time only has to exist, not to mean anything
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    return (time.perf_counter() - start) / runs * 1e3


def copy_bandwidth(cfg: Shapes) -> float:
    """Bytes/s of a device-to-device copy (read + write)."""
    src = torch.empty(cfg.copy_numel, dtype=cfg.dtype, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / (ms * 1e-3)


def matmul_flops(cfg: Shapes) -> float:
    n = cfg.matmul_n
    a = torch.randn(n, n, dtype=cfg.dtype, device=DEVICE)
    b = torch.randn(n, n, dtype=cfg.dtype, device=DEVICE)
    ms = bench_ms(lambda: a @ b)
    return 2 * n ** 3 / (ms * 1e-3)


def indptr(lengths) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out.to(DEVICE)


class Pool:
    """One K/V pool reused by every case; `slots(n, scattered)` gives n distinct slot ids."""

    def __init__(self, cfg: Shapes, num_slots: int):
        self.k = torch.empty(num_slots, cfg.kv_heads, cfg.head_dim, dtype=cfg.dtype,
                             device=DEVICE).normal_()
        self.v = torch.empty_like(self.k).normal_()
        self.perm = torch.randperm(num_slots, device=DEVICE, dtype=torch.int64).to(torch.int32)
        self.num_slots = num_slots

    def slots(self, n: int, scattered: bool) -> torch.Tensor:
        # Fewer slots than the context lengths promise would send the kernel past kv_indices.
        assert n <= self.num_slots, f"{n} slots wanted, the pool has {self.num_slots}"
        if scattered:
            return self.perm[:n]
        return torch.arange(n, device=DEVICE, dtype=torch.int32)


def run_attention(cfg: Shapes, pool, q_lens, kv_lens, scattered, num_kv_splits=None,
                  tile=None):
    """Returns (ms, splits used) of one paged_attention call."""
    from rollout_kernels.triton import paged_attention
    from rollout_kernels.triton.paged_attention import (
        _num_sms,
        choose_num_kv_splits,
        launch_paged_attention,
    )

    q = torch.randn(sum(q_lens), cfg.q_heads, cfg.head_dim, dtype=cfg.dtype, device=DEVICE)
    out = torch.empty_like(q)
    qo, kvp = indptr(q_lens), indptr(kv_lens)
    kv_indices = pool.slots(sum(kv_lens), scattered)
    kw = dict(sm_scale=cfg.head_dim ** -0.5, max_q_len=max(q_lens), max_kv_len=max(kv_lens))
    if tile is not None:
        def fn():
            launch_paged_attention(q, pool.k, pool.v, out, qo, kvp, kv_indices, causal=True,
                                   num_kv_splits=1, tile=tile, **kw)
        splits = 1
    else:
        def fn():
            paged_attention(q, pool.k, pool.v, out, qo, kvp, kv_indices,
                            num_kv_splits=num_kv_splits, **kw)
        splits = num_kv_splits or choose_num_kv_splits(
            len(q_lens) * cfg.kv_heads, max(q_lens), max(kv_lens), _num_sms(q.device))
    return bench_ms(fn), splits


def causal_flops(cfg: Shapes, q_lens, kv_lens) -> float:
    visible = sum(ql * (kl - ql) + ql * (ql + 1) // 2 for ql, kl in zip(q_lens, kv_lens))
    return 4.0 * cfg.q_heads * cfg.head_dim * visible


def check_correctness(cfg: Shapes, pool):
    from rollout_kernels.triton import paged_attention, paged_attention_ref

    scale = cfg.head_dim ** -0.5
    for q_lens, kv_lens, splits in cfg.check_cases:
        q = torch.randn(sum(q_lens), cfg.q_heads, cfg.head_dim, dtype=cfg.dtype, device=DEVICE)
        out = torch.empty_like(q)
        qo, kvp = indptr(q_lens), indptr(kv_lens)
        kv_indices = pool.slots(sum(kv_lens), True)
        paged_attention(q, pool.k, pool.v, out, qo, kvp, kv_indices, sm_scale=scale,
                        max_q_len=max(q_lens), max_kv_len=max(kv_lens), num_kv_splits=splits)
        ref = paged_attention_ref(q, pool.k, pool.v, qo, kvp, kv_indices, scale)
        err = (out.float() - ref.float()).abs().max().item()
        print(f"check q_lens={list(q_lens[:3])}.. kv_lens={list(kv_lens[:3])}..: max abs err "
              f"{err:.2e}" + ("" if err < 3e-2 else "  <-- WRONG"))


def bench_decode(cfg: Shapes, pool, copy_bw):
    print(f"\n== decode ({cfg.dtype_name}, {cfg.q_heads} q / {cfg.kv_heads} kv heads, "
          f"d {cfg.head_dim}): KV read bandwidth vs copy ==")
    print(f"{'batch':>5} {'ctx':>6} {'slots':>10} {'splits':>6} {'us':>9} {'GB/s':>7} {'%copy':>6}")
    for batch in cfg.decode_batches:
        for ctx in cfg.decode_contexts:
            if batch * ctx > pool.num_slots:
                print(f"{batch:>5} {ctx:>6}  skipped: {batch * ctx} slots > pool")
                continue
            layouts = (True, False) if batch in cfg.contiguous_batches else (True,)
            for scattered in layouts:
                ms, splits = run_attention(cfg, pool, [1] * batch, [ctx] * batch, scattered)
                bw = batch * ctx * cfg.kv_token_bytes / (ms * 1e-3)
                name = "scattered" if scattered else "contiguous"
                print(f"{batch:>5} {ctx:>6} {name:>10} {splits:>6} {ms * 1e3:>9.1f} "
                      f"{bw / 1e9:>7.0f} {100 * bw / copy_bw:>5.0f}%")
    for ctx in cfg.split_off_contexts:  # what split-KV buys at batch 1
        ms, _ = run_attention(cfg, pool, [1], [ctx], True, num_kv_splits=1)
        bw = ctx * cfg.kv_token_bytes / (ms * 1e-3)
        print(f"{1:>5} {ctx:>6} {'scattered':>10} {'1*':>6} {ms * 1e3:>9.1f} {bw / 1e9:>7.0f} "
              f"{100 * bw / copy_bw:>5.0f}%   (* split-KV forced off)")


def bench_prefill(cfg: Shapes, pool, mm_flops):
    print(f"\n== prefill / extend ({cfg.dtype_name}, causal): attention TFLOP/s vs "
          f"{cfg.dtype_name} matmul ==")
    print(f"{'case':>28} {'ms':>8} {'TFLOP/s':>8} {'%mm':>5}")
    for name, q_lens, kv_lens in cfg.prefill_cases:
        ms, _ = run_attention(cfg, pool, q_lens, kv_lens, False)
        flops = causal_flops(cfg, q_lens, kv_lens) / (ms * 1e-3)
        print(f"{name:>28} {ms:>8.2f} {flops / 1e12:>8.0f} {100 * flops / mm_flops:>4.0f}%")


def bench_tiles(cfg: Shapes, pool, copy_bw, mm_flops):
    print("\n== tile sweep (BLOCK_N, num_warps, num_stages); default marked * ==")
    from rollout_kernels.triton.paged_attention import _interpreting, _tile_config

    for name, q_lens, kv_lens, tiles in cfg.tile_sweep:
        # The default is the tile a launch here would really pick (BLOCK_N 16 when interpreting).
        _, _, bn, nw, ns = _tile_config(cfg.q_heads // cfg.kv_heads, max(q_lens), cfg.head_dim,
                                        cfg.dtype, _interpreting())
        for tile in tiles:
            try:
                ms, _ = run_attention(cfg, pool, q_lens, kv_lens, q_lens[0] == 1, tile=tile)
            except Exception as e:  # e.g. out of shared memory for this tile
                print(f"{name:>18} {str(tile):>14}  failed: {type(e).__name__}")
                continue
            if q_lens[0] == 1:
                bw = sum(kv_lens) * cfg.kv_token_bytes / (ms * 1e-3)
                score = f"{100 * bw / copy_bw:>4.0f}% copy"
            else:
                flops = causal_flops(cfg, q_lens, kv_lens) / (ms * 1e-3)
                score = f"{100 * flops / mm_flops:>4.0f}% mm"
            mark = "*" if tile == (bn, nw, ns) else " "
            print(f"{name:>18} {str(tile):>14}{mark} {ms * 1e3:>9.1f} us  {score}")


def bench_shared_prefix(cfg: Shapes, pool):
    print(f"\n== shared prefix: {cfg.shared_groups} prompts x n={cfg.shared_n}, "
          f"{cfg.shared_generated} generated tokens ==")
    for prompt in cfg.shared_prompts:
        shared_prefix_case(cfg, pool, groups=cfg.shared_groups, n=cfg.shared_n, prefix=prompt,
                           generated=cfg.shared_generated)


def shared_prefix_case(cfg: Shapes, pool, groups: int, n: int, prefix: int, generated: int):
    from rollout_kernels.triton import paged_attention, shared_prefix_attention
    from rollout_kernels.triton.shared_prefix import shared_prefix_kv_bytes

    batch, suffix = groups * n, generated  # timed at the last decode step
    all_slots = pool.slots(groups * prefix + batch * suffix, True)
    prefix_slots, suffix_slots = all_slots[:groups * prefix], all_slots[groups * prefix:]
    q = torch.randn(batch, cfg.q_heads, cfg.head_dim, dtype=cfg.dtype, device=DEVICE)
    out = torch.empty_like(q)
    per_req = [torch.cat([prefix_slots[g * prefix:(g + 1) * prefix],
                          suffix_slots[(g * n + i) * suffix:(g * n + i + 1) * suffix]])
               for g in range(groups) for i in range(n)]
    kv_indices = torch.cat(per_req)
    qo, kvp = indptr([1] * batch), indptr([prefix + suffix] * batch)
    scale = cfg.head_dim ** -0.5
    plain_ms = bench_ms(lambda: paged_attention(
        q, pool.k, pool.v, out, qo, kvp, kv_indices, sm_scale=scale, max_q_len=1,
        max_kv_len=prefix + suffix))
    ref = out.clone()
    gp, pp, sp = indptr([n] * groups), indptr([prefix] * groups), indptr([suffix] * batch)
    shared_ms = bench_ms(lambda: shared_prefix_attention(
        q, pool.k, pool.v, out, gp, pp, prefix_slots, sp, suffix_slots, sm_scale=scale,
        max_group_size=n, max_prefix_len=prefix, max_suffix_len=suffix))
    err = (out.float() - ref.float()).abs().max().item()

    def kv_bytes(step_suffix: int) -> tuple[int, int]:
        return shared_prefix_kv_bytes([n] * groups, [prefix] * groups, [step_suffix] * batch,
                                      cfg.kv_token_bytes // 2)

    # Decode step t (1-based) reads the prompt and the t tokens generated so far.
    steps = [kv_bytes(t) for t in range(1, generated + 1)]
    last_plain, last_shared = steps[-1]
    gen_plain, gen_shared = (sum(b) for b in zip(*steps))
    print(f"prompt {prefix}: KV bytes per layer, last step: plain {last_plain / 2**20:.0f} MiB, "
          f"shared {last_shared / 2**20:.0f} MiB "
          f"(saves {100 * (1 - last_shared / last_plain):.0f}%); whole generation: "
          f"plain {gen_plain / 2**30:.2f} GiB, shared {gen_shared / 2**30:.2f} GiB "
          f"(saves {100 * (1 - gen_shared / gen_plain):.0f}%)")
    print(f"prompt {prefix}: last step time: plain {plain_ms * 1e3:.0f} us, shared "
          f"{shared_ms * 1e3:.0f} us ({plain_ms / shared_ms:.2f}x); max abs diff {err:.1e}"
          + ("" if err < 3e-2 else "  <-- WRONG"))


def bench_sampler(cfg: Shapes):
    from rollout.sample.sampler import SamplingBatch
    from rollout.sample.sampler import sample as sample_ref
    from rollout_kernels.triton import sample

    batch, vocab = cfg.sampler_batch, cfg.sampler_vocab
    print(f"\n== sampler: batch {batch}, vocab {vocab}, fp32 logits ==")
    logits = torch.randn(batch, vocab, device=DEVICE) * 3
    for name, k, p, m in (("temperature only", 0, 1.0, 0.0), ("top-k 50 + top-p 0.9", 50, 0.9, 0.0),
                          ("top-p 0.95 + min-p 0.05", 0, 0.95, 0.05)):
        params = SamplingBatch.build([1.0] * batch, [k] * batch, [p] * batch, [m] * batch,
                                     list(range(batch)), [100] * batch, DEVICE)
        args = (params.temperature, params.top_k, params.top_p, params.min_p, params.seed,
                params.position)
        tri_ms = bench_ms(lambda: sample(logits, *args))
        ref_ms = bench_ms(lambda: sample_ref(logits, params))
        (tokens, logprobs), (ref_tokens, ref_logprobs) = (sample(logits, *args),
                                                          sample_ref(logits, params))
        logp_err = (logprobs - ref_logprobs).abs().max().item()
        print(f"{name:>26}: triton {tri_ms * 1e3:>7.0f} us, torch {ref_ms * 1e3:>7.0f} us, "
              f"logprob max diff {logp_err:.1e}{'' if logp_err < 1e-4 else '  <-- WRONG'}, "
              f"tokens equal: {torch.equal(tokens, ref_tokens)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="every section with tiny shapes on any device: checks the script")
    args = parser.parse_args(argv)
    if DEVICE != "cuda" and not args.smoke:
        print("bench/triton_kernels.py measures Triton kernels on a CUDA GPU; none found, nothing to do.")
        return 0
    cfg = SMOKE if args.smoke else GPU
    start = time.time()
    torch.manual_seed(0)
    if args.smoke:
        from rollout_kernels.triton.paged_attention import _interpreting

        print(f"smoke run: tiny shapes, Triton interpreter {'on' if _interpreting() else 'off'}"
              "; the numbers mean nothing, only that every section runs")
    print(f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE}")
    copy_bw = copy_bandwidth(cfg)
    mm_flops = matmul_flops(cfg)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write); {cfg.dtype_name} matmul "
          f"{mm_flops / 1e12:.0f} TFLOP/s")
    num_slots = cfg.pool_slots
    if DEVICE == "cuda":
        free, _ = torch.cuda.mem_get_info()
        num_slots = min(num_slots, int(free * 0.8) // cfg.kv_token_bytes)
    pool = Pool(cfg, num_slots)
    print(f"pool: {pool.num_slots} slots ({pool.num_slots * cfg.kv_token_bytes / 2**30:.1f} GiB)")
    check_correctness(cfg, pool)
    bench_decode(cfg, pool, copy_bw)
    bench_prefill(cfg, pool, mm_flops)
    bench_tiles(cfg, pool, copy_bw, mm_flops)
    bench_shared_prefix(cfg, pool)
    del pool
    torch.cuda.empty_cache()
    bench_sampler(cfg)
    print(f"\ntotal {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
