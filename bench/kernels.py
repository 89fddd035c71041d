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

    python bench/kernels.py          # ~1-2 minutes on an H200
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
KV_TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50)


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write)."""
    src = torch.empty(2 << 30, dtype=DTYPE, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / (ms * 1e-3)


def matmul_flops() -> float:
    n = 8192
    a = torch.randn(n, n, dtype=DTYPE, device="cuda")
    b = torch.randn(n, n, dtype=DTYPE, device="cuda")
    ms = bench_ms(lambda: a @ b)
    return 2 * n ** 3 / (ms * 1e-3)


def indptr(lengths) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out.cuda()


class Pool:
    """One K/V pool reused by every case; `slots(n, scattered)` gives n distinct slot ids."""

    def __init__(self, num_slots: int):
        self.k = torch.empty(num_slots, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda").normal_()
        self.v = torch.empty_like(self.k).normal_()
        self.perm = torch.randperm(num_slots, device="cuda", dtype=torch.int64).to(torch.int32)
        self.num_slots = num_slots

    def slots(self, n: int, scattered: bool) -> torch.Tensor:
        if scattered:
            return self.perm[:n]
        return torch.arange(n, device="cuda", dtype=torch.int32)


def run_attention(pool, q_lens, kv_lens, scattered, num_kv_splits=None, tile=None):
    """Returns (ms, splits used) of one paged_attention call."""
    from kernels.paged_attention import _num_sms, choose_num_kv_splits, launch_paged_attention
    from kernels import paged_attention

    q = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    qo, kvp = indptr(q_lens), indptr(kv_lens)
    kv_indices = pool.slots(sum(kv_lens), scattered)
    kw = dict(sm_scale=HEAD_DIM ** -0.5, max_q_len=max(q_lens), max_kv_len=max(kv_lens))
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
            len(q_lens) * KV_HEADS, max(q_lens), max(kv_lens), _num_sms(q.device))
    return bench_ms(fn), splits


def causal_flops(q_lens, kv_lens) -> float:
    visible = sum(ql * (kl - ql) + ql * (ql + 1) // 2 for ql, kl in zip(q_lens, kv_lens))
    return 4.0 * Q_HEADS * HEAD_DIM * visible


def check_correctness(pool):
    from kernels import paged_attention, paged_attention_ref

    for q_lens, kv_lens, splits in (([1] * 16, [1000 + 7 * i for i in range(16)], None),
                                    ([1] * 2, [3000, 20], 8), ([300, 77], [812, 77], None)):
        q = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        out = torch.empty_like(q)
        qo, kvp = indptr(q_lens), indptr(kv_lens)
        kv_indices = pool.slots(sum(kv_lens), True)
        paged_attention(q, pool.k, pool.v, out, qo, kvp, kv_indices, sm_scale=HEAD_DIM ** -0.5,
                        max_q_len=max(q_lens), max_kv_len=max(kv_lens), num_kv_splits=splits)
        ref = paged_attention_ref(q, pool.k, pool.v, qo, kvp, kv_indices, HEAD_DIM ** -0.5)
        err = (out.float() - ref.float()).abs().max().item()
        print(f"check q_lens={q_lens[:3]}.. kv_lens={kv_lens[:3]}..: max abs err {err:.2e}"
              + ("" if err < 3e-2 else "  <-- WRONG"))


def bench_decode(pool, copy_bw):
    print("\n== decode (bf16, 32 q / 8 kv heads, d 128): KV read bandwidth vs copy ==")
    print(f"{'batch':>5} {'ctx':>6} {'slots':>10} {'splits':>6} {'us':>9} {'GB/s':>7} {'%copy':>6}")
    for batch in (1, 16, 128, 256):
        for ctx in (1024, 8192, 32768):
            if batch * ctx > pool.num_slots:
                print(f"{batch:>5} {ctx:>6}  skipped: {batch * ctx} slots > pool")
                continue
            layouts = (True, False) if batch in (1, 128) else (True,)
            for scattered in layouts:
                ms, splits = run_attention(pool, [1] * batch, [ctx] * batch, scattered)
                bw = batch * ctx * KV_TOKEN_BYTES / (ms * 1e-3)
                name = "scattered" if scattered else "contiguous"
                print(f"{batch:>5} {ctx:>6} {name:>10} {splits:>6} {ms * 1e3:>9.1f} "
                      f"{bw / 1e9:>7.0f} {100 * bw / copy_bw:>5.0f}%")
    for ctx in (8192, 32768):  # what split-KV buys at batch 1
        ms, _ = run_attention(pool, [1], [ctx], True, num_kv_splits=1)
        bw = ctx * KV_TOKEN_BYTES / (ms * 1e-3)
        print(f"{1:>5} {ctx:>6} {'scattered':>10} {'1*':>6} {ms * 1e3:>9.1f} {bw / 1e9:>7.0f} "
              f"{100 * bw / copy_bw:>5.0f}%   (* split-KV forced off)")


def bench_prefill(pool, mm_flops):
    print("\n== prefill / extend (bf16, causal): attention TFLOP/s vs bf16 matmul ==")
    print(f"{'case':>28} {'ms':>8} {'TFLOP/s':>8} {'%mm':>5}")
    cases = (("prefill 4 x 4096", [4096] * 4, [4096] * 4),
             ("prefill 1 x 16384", [16384], [16384]),
             ("extend 4 x 1024 over 7168", [1024] * 4, [8192] * 4),
             ("extend 8 x 512 over 3584", [512] * 8, [4096] * 8))
    for name, q_lens, kv_lens in cases:
        ms, _ = run_attention(pool, q_lens, kv_lens, False)
        flops = causal_flops(q_lens, kv_lens) / (ms * 1e-3)
        print(f"{name:>28} {ms:>8.2f} {flops / 1e12:>8.0f} {100 * flops / mm_flops:>4.0f}%")


def bench_tiles(pool, copy_bw, mm_flops):
    print("\n== tile sweep (BLOCK_N, num_warps, num_stages); default marked * ==")
    from kernels.paged_attention import _tile_config

    for name, q_lens, kv_lens, tiles in (
            ("decode 128 x 8K", [1] * 128, [8192] * 128,
             [(32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3)]),
            ("prefill 4 x 4096", [4096] * 4, [4096] * 4,
             [(32, 8, 2), (64, 8, 2), (64, 8, 3), (128, 8, 2), (64, 4, 2)])):
        _, _, bn, nw, ns = _tile_config(Q_HEADS // KV_HEADS, max(q_lens), HEAD_DIM, DTYPE, False)
        for tile in tiles:
            try:
                ms, _ = run_attention(pool, q_lens, kv_lens, q_lens[0] == 1, tile=tile)
            except Exception as e:  # e.g. out of shared memory for this tile
                print(f"{name:>18} {str(tile):>14}  failed: {type(e).__name__}")
                continue
            if q_lens[0] == 1:
                score = f"{100 * sum(kv_lens) * KV_TOKEN_BYTES / (ms * 1e-3) / copy_bw:>4.0f}% copy"
            else:
                score = f"{100 * causal_flops(q_lens, kv_lens) / (ms * 1e-3) / mm_flops:>4.0f}% mm"
            mark = "*" if tile == (bn, nw, ns) else " "
            print(f"{name:>18} {str(tile):>14}{mark} {ms * 1e3:>9.1f} us  {score}")


def bench_shared_prefix(pool):
    print("\n== shared prefix: 16 prompts x n=8, 256 generated tokens ==")
    for prompt in (1024, 4096):
        shared_prefix_case(pool, groups=16, n=8, prefix=prompt, generated=256)


def shared_prefix_case(pool, groups: int, n: int, prefix: int, generated: int):
    from kernels import paged_attention, shared_prefix_attention
    from kernels.shared_prefix import shared_prefix_kv_bytes

    batch, suffix = groups * n, generated  # timed at the last decode step
    prefix_slots = pool.slots(groups * prefix, True)
    suffix_slots = pool.perm[groups * prefix: groups * prefix + batch * suffix]
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    per_req = [torch.cat([prefix_slots[g * prefix:(g + 1) * prefix],
                          suffix_slots[(g * n + i) * suffix:(g * n + i + 1) * suffix]])
               for g in range(groups) for i in range(n)]
    kv_indices = torch.cat(per_req)
    qo, kvp = indptr([1] * batch), indptr([prefix + suffix] * batch)
    scale = HEAD_DIM ** -0.5
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
                                      KV_TOKEN_BYTES // 2)

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
          f"{shared_ms * 1e3:.0f} us ({plain_ms / shared_ms:.2f}x); max abs diff {err:.1e}")


def bench_sampler():
    from kernels import sample
    from rollout.sampler import SamplingBatch
    from rollout.sampler import sample as sample_ref

    print("\n== sampler: batch 128, vocab 128256, fp32 logits ==")
    batch, vocab = 128, 128256
    logits = torch.randn(batch, vocab, device="cuda") * 3
    for name, k, p, m in (("temperature only", 0, 1.0, 0.0), ("top-k 50 + top-p 0.9", 50, 0.9, 0.0),
                          ("top-p 0.95 + min-p 0.05", 0, 0.95, 0.05)):
        params = SamplingBatch.build([1.0] * batch, [k] * batch, [p] * batch, [m] * batch,
                                     list(range(batch)), [100] * batch, "cuda")
        args = (params.temperature, params.top_k, params.top_p, params.min_p, params.seed,
                params.position)
        tri_ms = bench_ms(lambda: sample(logits, *args))
        ref_ms = bench_ms(lambda: sample_ref(logits, params))
        same = torch.equal(sample(logits, *args)[0], sample_ref(logits, params)[0])
        print(f"{name:>26}: triton {tri_ms * 1e3:>7.0f} us, torch {ref_ms * 1e3:>7.0f} us, "
              f"tokens equal: {same}")


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/kernels.py measures Triton kernels on a CUDA GPU; none found, nothing to do.")
        return 0
    start = time.time()
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}")
    copy_bw = copy_bandwidth()
    mm_flops = matmul_flops()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write); bf16 matmul "
          f"{mm_flops / 1e12:.0f} TFLOP/s")
    free, _ = torch.cuda.mem_get_info()
    want = 256 * 32768  # the largest decode case
    fit = int(free * 0.8) // KV_TOKEN_BYTES
    pool = Pool(min(want, fit))
    print(f"pool: {pool.num_slots} slots ({pool.num_slots * KV_TOKEN_BYTES / 2**30:.1f} GiB)")
    check_correctness(pool)
    bench_decode(pool, copy_bw)
    bench_prefill(pool, mm_flops)
    bench_tiles(pool, copy_bw, mm_flops)
    bench_shared_prefix(pool)
    del pool
    torch.cuda.empty_cache()
    bench_sampler()
    print(f"\ntotal {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
