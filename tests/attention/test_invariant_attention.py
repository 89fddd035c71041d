"""The batch-invariant attention: the C kernel's invariant mode (rollout/attention/invariant.py)
and the Triton kernel's (under the interpreter off CUDA). Every request's rows are the same bits
in a mixed step as in a step of its own, and a prefill's rows the same whether it ran whole or
in chunks (the later ones extending over the earlier); fp32 and bf16, with sliding windows and
soft-capping; and they are attention (a float64 reference)."""

import contextlib
import dataclasses
import os

import pytest
import torch
from kernels_env import rows_rounded_by_position
from test_native_attention import native_forward
from test_torch_shared_prefix import MIXED, make_step, random_pool, reference

from rollout.attention.invariant import InvariantCpuAttention
from rollout.attention.metadata import AttentionMetadata, indptr
from rollout_kernels.cpu import paged_attention as native_attention

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


def triton_backend(pool, windows):
    from rollout.attention.triton import TritonAttention

    return TritonAttention(pool, windows, invariant=True)


CPU = pytest.param(InvariantCpuAttention, id="cpu", marks=pytest.mark.skipif(
    not native_attention.built(), reason=native_attention.why_not()))
TRITON = pytest.param(triton_backend, id="triton", marks=pytest.mark.skipif(
    not INTERPRETED, reason="the Triton kernel on the CPU runs under TRITON_INTERPRET=1"))
# (backend, dtype): the interpreter runs fp32 and fp16 only
CASES = [pytest.param(*CPU.values, torch.float32, id="cpu-fp32", marks=CPU.marks),
         pytest.param(*CPU.values, torch.bfloat16, id="cpu-bf16", marks=CPU.marks),
         pytest.param(*TRITON.values, torch.float32, id="triton-fp32", marks=TRITON.marks)]
HEADS = [(3, 9, 64), (2, 4, 32), (2, 6, 40)]
# Every head shape on the C kernel; one under the (slow) interpreter: GQA 2, d % 32 == 0.
STEP_CASES = [pytest.param(*case.values, *heads, id=f"{case.id}-{'-'.join(map(str, heads))}",
                           marks=case.marks)
              for case in CASES for heads in (HEADS if case.id.startswith("cpu") else HEADS[1:2])]


def forward(backend, meta, q, k, v, softcap):
    meta = dataclasses.replace(meta, plan=None)
    meta.plan = backend.plan(meta)
    interpreted = type(backend).__name__ == "TritonAttention"
    with rows_rounded_by_position() if interpreted else contextlib.nullcontext():
        return backend.forward(q, k, v, 0, meta, backend.pool.head_dim ** -0.5, softcap)


def rows_of(meta, b, lo=0, hi=None):
    """Queries lo..hi of request b as a step of its own: its context up to its query hi - 1
    (the queries before lo as cached context), its new tokens' slots."""
    q0, q_len = int(meta.qo_indptr[b]), meta.q_lens[b]
    kv0, kv_len = int(meta.kv_indptr[b]), meta.kv_lens[b]
    hi = q_len if hi is None else hi
    context = kv_len - q_len + hi
    one = AttentionMetadata(
        qo_indptr=indptr([hi - lo], "cpu"), kv_indptr=indptr([context], "cpu"),
        kv_indices=meta.kv_indices[kv0:kv0 + context], out_slots=meta.out_slots[q0 + lo:q0 + hi],
        q_lens=[hi - lo], kv_lens=[context], groups=[meta.groups[b]],
        shared_lens=[meta.shared_lens[b]])
    return one, slice(q0 + lo, q0 + hi)


# MIXED with a group sharing 70 slots (past one key block, not a multiple of it) and a long
# prefill, so that shared prefixes end inside a block and prefill rows meet decode rows.
STEP = MIXED + [("i", 70, 75, 1), ("i", 70, 140, 1), ("i", 70, 90, 4), ("j", 0, 130, 130)]
WINDOWS = [(None, None), (7, None), (None, 20.0), (50, 3.0)]
# The (slow) interpreter: none, and a window with soft-capping together.
TRITON_WINDOWS = [WINDOWS[0], WINDOWS[3]]
CUTS = [(57,), (1, 64), (20, 33, 100)]


def with_windows(cases, more=((),)):
    """Each case with every window on the C kernel, TRITON_WINDOWS under the interpreter; with
    each of `more`'s extra arguments (the interpreter only the last)."""
    return [pytest.param(*case.values, *window, *extra, marks=case.marks,
                         id="-".join(map(str, (case.id, *window, *extra))))
            for case in cases
            for window in (WINDOWS if case.id.startswith("cpu") else TRITON_WINDOWS)
            for extra in (more if case.id.startswith("cpu") else more[-1:])]


@pytest.mark.parametrize("make, dtype, kv_heads, q_heads, head_dim, window, softcap",
                         with_windows(STEP_CASES))
def test_each_request_alone_equals_its_rows_in_the_step(make, dtype, kv_heads, q_heads, head_dim,
                                                        window, softcap):
    pool = random_pool(1, kv_heads, head_dim, dtype=dtype)
    meta, q, k, v = make_step(pool, STEP, q_heads, seed=head_dim, dtype=dtype, common=24)
    backend = make(pool, [window])
    out = forward(backend, meta, q, k, v, softcap)
    for b in range(len(meta.q_lens)):
        one, rows = rows_of(meta, b)
        assert torch.equal(forward(backend, one, q[rows], k[rows], v[rows], softcap), out[rows])
    ref = reference(pool, meta, q, 0, head_dim ** -0.5, window, softcap)
    # fp32: the C kernel's own bound (test_native_attention.py); bf16: one rounding of the
    # output (2^-8 relative)
    bound = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(out.double(), ref, **bound)


@pytest.mark.parametrize("make, dtype, window, softcap, cuts",
                         with_windows(CASES, [(cuts,) for cuts in CUTS]))
def test_a_prefill_in_chunks_equals_it_whole(make, dtype, window, softcap, cuts):
    pool = random_pool(1, 2, 64, dtype=dtype)
    meta, q, k, v = make_step(pool, [("j", 0, 130, 130)], 6, seed=7, dtype=dtype)
    backend = make(pool, [window])
    whole = forward(backend, meta, q, k, v, softcap)
    for lo, hi in zip((0, *cuts), (*cuts, 130)):
        one, rows = rows_of(meta, 0, lo, hi)
        assert torch.equal(forward(backend, one, q[rows], k[rows], v[rows], softcap),
                           whole[rows]), (lo, hi)


@pytest.mark.skipif(not native_attention.built(), reason=native_attention.why_not())
def test_the_default_kernel_is_not_invariant():
    """The check above can fail: the default mode reads a shared prefix's blocks from its own
    start and tiles many rows' scores differently, so some request's rows change bits."""
    pool = random_pool(1, 3, 64)
    meta, q, k, v = make_step(pool, STEP, 9, seed=64, common=24)
    out, _ = native_forward(pool, meta, q, k, v)
    differ = 0
    for b in range(len(meta.q_lens)):
        one, rows = rows_of(meta, b)
        differ += not torch.equal(native_forward(pool, one, q[rows], k[rows], v[rows])[0],
                                  out[rows])
    assert differ > 0
