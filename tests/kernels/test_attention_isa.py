"""paged_attention.c's wide path (a shared prefix's keys on the lanes, for 12 rows or more) gives
the same bits in 16-lane vectors (attention_avx512.h: an Intel core's build) as in the AVX2
loops (an AVX2 host's build, and a Zen 4's): each score is one chain of FMAs over the
dimensions in its own lane, each output element one chain over the keys. Cases cover a last
key block of 1..15 keys past a multiple of 16, row counts that are no multiple of the 6-row and
4-row tiles, head dims the 64-dim value loop takes whole (64, 128) and leaves to the AVX2 one
(32, 96), GQA and MHA, a softcap and queries of several tokens sharing a prefix."""

import textwrap
from pathlib import Path

import pytest
import torch
from floors import assert_as_exact_as
from native_builds import computed

from rollout_kernels import cpu as native
from rollout_kernels.cpu import paged_attention

AVX512 = "avx512f" in native._cpu_features().split()

# (requests, queries each, shared prefix, own keys each, q heads, kv heads, head dim, softcap)
CASES = [(32, 1, 100, 5, 9, 3, 64, 0.0), (32, 1, 64, 3, 6, 2, 128, 0.0),
         (24, 1, 37, 2, 8, 2, 96, 30.0), (48, 1, 129, 4, 4, 4, 32, 0.0),
         (6, 7, 150, 0, 9, 3, 64, 0.0), (14, 1, 17, 1, 3, 1, 64, 0.0)]

COMPUTE = """
    import sys
    import torch
    from rollout_kernels.cpu import paged_attention as native
    assert native.built(), native.why_not()
    torch.set_num_threads(1)  # the same chunks (and so the same wide rows) in every build
    out = []
    for b, nq, prefix, own, hq, hkv, d, softcap in CASES:
        g = torch.Generator().manual_seed(b * 1000 + prefix * 10 + d)
        slots = prefix + b * (own + nq)
        k, v = (torch.randn(slots, hkv, d, generator=g) for _ in range(2))
        q = torch.randn(b * nq, hq, d, generator=g)
        indices, starts = [], []
        for r in range(b):
            starts.append(len(indices))
            first = prefix + r * (own + nq)
            indices += list(range(prefix)) + list(range(first, first + own + nq))
        rows = native.NativeRows.of(list(range(b)), [r * nq for r in range(b)], [nq] * b,
                                    starts, [prefix + own + nq] * b, torch.tensor(indices))
        o = torch.empty_like(q)
        native.paged_attention(q, k, v, o, rows, d ** -0.5, None, softcap or None)
        out.append((q, k, v, indices, o))
    torch.save(out, sys.argv[1])
"""


def compute(path: Path, **env) -> list:
    return computed(f"CASES = {CASES!r}\n" + textwrap.dedent(COMPUTE), path, **env)


def reference(q, k, v, indices, nq, hq, hkv, softcap, dtype):
    """The requests' attention in `dtype` by plain tensor ops (each request's context gathered,
    causal over its own queries)."""
    b = q.shape[0] // nq
    per = len(indices) // b
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = []
    for r in range(b):
        ctx = torch.tensor(indices[r * per:(r + 1) * per])
        keys = k[ctx].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [hq, n, d]
        vals = v[ctx].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        qr = q[r * nq:(r + 1) * nq].transpose(0, 1)  # [hq, nq, d]
        s = qr @ keys.transpose(1, 2) * q.shape[-1] ** -0.5
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(per - nq, per)[:, None]
        s = s.masked_fill(torch.arange(per)[None, :] > pos, float("-inf"))
        out.append((s.softmax(-1) @ vals).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.skipif(not AVX512, reason="needs a CPU with AVX-512 to run both widths")
@pytest.mark.skipif(not paged_attention.built(), reason=paged_attention.why_not())
def test_the_wide_path_gives_the_same_bits_in_16_and_8_lanes(tmp_path):
    # this host's build, an AVX2 build, and an AVX-512 build told to take the 16-lane loops
    # (a Zen 4's own build keeps the AVX2 ones: without it a Zen 4 would compare AVX2 twice)
    native_out = compute(tmp_path / "native.pt")
    avx2 = compute(tmp_path / "avx2.pt", ROLLOUT_CACHE=str(tmp_path / "cache2"),
                   ROLLOUT_NATIVE_MARCH="x86-64-v3")
    wide = compute(tmp_path / "wide.pt", ROLLOUT_CACHE=str(tmp_path / "cache512"),
                   ROLLOUT_NATIVE_CFLAGS="-DATTENTION_512=1")
    for case, a, b, c in zip(CASES, native_out, avx2, wide, strict=True):
        assert torch.equal(a[-1], b[-1]) and torch.equal(a[-1], c[-1]), case
    # and the bits are attention's (not zeros, not garbage past a block's last key)
    for (b, nq, prefix, own, hq, hkv, d, softcap), (q, k, v, indices, o) in zip(CASES, wide):
        exact = reference(q, k, v, indices, nq, hq, hkv, softcap, torch.float64)
        assert_as_exact_as(o, exact, reference(q, k, v, indices, nq, hq, hkv, softcap,
                                               torch.float32), f"attention {b}x{nq}, d={d}")
