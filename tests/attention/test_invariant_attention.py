"""The batch-invariant attention (rollout/attention/invariant.py, the C kernel's invariant
mode): every request's rows are the same bits in a mixed step as in a step of its own, fp32 and
bf16, with windows and soft-capping; and they are attention (a float64 reference)."""

import dataclasses

import pytest
import torch
from test_native_attention import native_forward, reference
from test_torch_shared_prefix import MIXED, make_step, random_pool

from rollout.attention.invariant import InvariantCpuAttention
from rollout.attention.metadata import AttentionMetadata, indptr
from rollout_kernels.cpu import paged_attention as native_attention

pytestmark = pytest.mark.skipif(not native_attention.built(),
                                reason=native_attention.why_not())


def forward(backend, meta, q, k, v, softcap):
    meta = dataclasses.replace(meta, plan=None)
    meta.plan = backend.plan(meta)
    return backend.forward(q, k, v, 0, meta, backend.pool.head_dim ** -0.5, softcap)


def alone(meta, b):
    """Request b of the step as a step of its own (its slots, its new tokens)."""
    q0, q1 = int(meta.qo_indptr[b]), int(meta.qo_indptr[b + 1])
    kv0, kv1 = int(meta.kv_indptr[b]), int(meta.kv_indptr[b + 1])
    one = AttentionMetadata(
        qo_indptr=indptr([q1 - q0], "cpu"), kv_indptr=indptr([kv1 - kv0], "cpu"),
        kv_indices=meta.kv_indices[kv0:kv1], out_slots=meta.out_slots[q0:q1],
        q_lens=[q1 - q0], kv_lens=[kv1 - kv0], groups=[meta.groups[b]],
        shared_lens=[meta.shared_lens[b]])
    return one, slice(q0, q1)


# MIXED with a group sharing 70 slots (past one key block, not a multiple of it) and a long
# prefill, so that shared prefixes end inside a block and prefill rows meet decode rows.
STEP = MIXED + [("i", 70, 75, 1), ("i", 70, 140, 1), ("i", 70, 90, 4), ("j", 0, 130, 130)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 20.0), (50, 3.0)])
@pytest.mark.parametrize("kv_heads, q_heads, head_dim", [(3, 9, 64), (2, 4, 32), (2, 6, 40)])
def test_each_request_alone_equals_its_rows_in_the_step(dtype, window, softcap, kv_heads,
                                                        q_heads, head_dim):
    pool = random_pool(1, kv_heads, head_dim, dtype=dtype)
    meta, q, k, v = make_step(pool, STEP, q_heads, seed=head_dim, dtype=dtype, common=24)
    backend = InvariantCpuAttention(pool, [window])
    out = forward(backend, meta, q, k, v, softcap)
    for b in range(len(meta.q_lens)):
        one, rows = alone(meta, b)
        assert torch.equal(forward(backend, one, q[rows], k[rows], v[rows], softcap), out[rows])
    ref = reference(pool, meta, q, 0, head_dim ** -0.5, window, softcap)
    # fp32: the kernel's own bound (test_native_attention.py); bf16: one rounding of the output
    bound = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(out.double(), ref, **bound)


def test_the_default_kernel_is_not_invariant():
    """The check above can fail: the default mode reads a shared prefix's blocks from its own
    start and tiles many rows' scores differently, so some request's rows change bits."""
    pool = random_pool(1, 3, 64)
    meta, q, k, v = make_step(pool, STEP, 9, seed=64, common=24)
    out, _ = native_forward(pool, meta, q, k, v)
    differ = 0
    for b in range(len(meta.q_lens)):
        one, rows = alone(meta, b)
        differ += not torch.equal(native_forward(pool, one, q[rows], k[rows], v[rows])[0],
                                  out[rows])
    assert differ > 0
