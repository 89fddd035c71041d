"""Shared setup of the Triton kernel tests (tests/test_kernels_*.py).

conftest.py sets TRITON_INTERPRET=1 when there is no GPU, before any triton.jit decorator
runs. On a GPU the same tests run compiled and add bf16; bf16 is left out on the CPU because
the interpreter's bf16 tl.dot is wrong.
"""

import contextlib

import numpy as np
import torch
from floors import assert_as_exact_as

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def device_for(backend: str) -> torch.device:
    """Where a test of an engine backend runs: "triton" on the GPU when there is one (its
    interpreter on the CPU otherwise), the other backends on the CPU."""
    return torch.device(DEVICE if backend == "triton" else "cpu")


def indptr(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def scattered_slots(num_slots: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """`count` distinct pool slots in random order, never slot 0 (see `poison_unused_slots`)."""
    return (torch.randperm(num_slots - 1, generator=gen)[:count] + 1).to(torch.int32).to(DEVICE)


def poison_unused_slots(k_pool: torch.Tensor, v_pool: torch.Tensor, used: torch.Tensor) -> None:
    """Slots outside every context hold NaN, as an uninitialised pool may; slot 0 among them,
    which the attention kernel reads (and masks) past the end of a context."""
    unused = torch.ones(k_pool.shape[0], dtype=torch.bool, device=k_pool.device)
    unused[used.long()] = False
    k_pool[unused] = float("nan")
    v_pool[unused] = float("nan")


def attention_in(dtype, q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, scale,
                 causal=True, window=None, softcap=None):
    """paged_attention_ref with every step in `dtype`, on the CPU: in float64 the exact
    answer; in fp16/bf16 torch's own rounding of it in the kernel's low dtype."""
    from rollout_kernels.triton import paged_attention_ref

    return paged_attention_ref(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, scale,
                               causal, window=window, softcap=softcap, dtype=dtype).cpu()


def assert_attention_as_exact(out, ref, *args, **kwargs):
    """The kernel's `out` as near the float64 answer as torch's own computation in its dtype:
    `ref` (paged_attention_ref) in fp32; in fp16/bf16 attention_in(dtype), as ref computes in
    fp32 and rounds once where the kernel multiplies P in the low dtype. `args`: attention_in's
    after the dtype, and `kwargs`."""
    floor = ref.cpu() if out.dtype == torch.float32 else attention_in(out.dtype, *args, **kwargs)
    assert_as_exact_as(out.cpu(), attention_in(torch.float64, *args, **kwargs), floor,
                       "attention output")


def paged_case(q_lens, kv_lens, q_heads, kv_heads, head_dim, dtype, *, causal=True, splits=None,
               seed=0, index_dtype=torch.int32, window=None, softcap=None, q_scale=1.0):
    """paged_attention against paged_attention_ref on a pool with scattered slots (unused ones
    NaN), held to the float64 answer by assert_attention_as_exact; returns the reference
    output."""
    from rollout_kernels.triton import paged_attention, paged_attention_ref

    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(kv_lens) + 13
    k_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    kv_indices = scattered_slots(num_slots, sum(kv_lens), gen)
    poison_unused_slots(k_pool, v_pool, kv_indices)
    q = (q_scale * torch.randn(sum(q_lens), q_heads, head_dim, generator=gen)).to(DEVICE, dtype)
    qo_indptr, kv_indptr = indptr(q_lens), indptr(kv_lens)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    kv_indices = kv_indices.to(index_dtype)
    paged_attention(q, k_pool, v_pool, out, qo_indptr, kv_indptr, kv_indices, sm_scale=scale,
                    max_q_len=max(q_lens), max_kv_len=max(kv_lens), causal=causal,
                    num_kv_splits=splits, window=window, softcap=softcap)
    ref = paged_attention_ref(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, scale,
                              causal, window=window, softcap=softcap)
    assert_attention_as_exact(out, ref, q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices,
                              scale, causal, window=window, softcap=softcap)
    return ref


@contextlib.contextmanager
def rows_rounded_by_position():
    """np.matmul, the interpreter's tl.dot, rounding a row by where it sits in the matrix (the
    odd rows one ulp up): OpenBLAS on AVX2 hosts does (a row moved in the matrix changed bits),
    on AVX-512 hosts it did not. A batch-invariant Triton kernel must round a row alike wherever
    batching puts it, on every host (the attention: a token in the same row of its tile however
    its request was chunked; the projections: no tl.dot under the interpreter, row_invariant.
    row_dot). On a GPU it changes nothing."""
    matmul = np.matmul

    def by_position(a, b, *args, **kwargs):
        out = matmul(a, b, *args, **kwargs)
        out[..., 1::2, :] = np.nextafter(out[..., 1::2, :], np.inf)
        return out

    np.matmul = by_position
    try:
        yield
    finally:
        np.matmul = matmul
