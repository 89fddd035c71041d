"""linear.c's register blockings give the same bits: on a CPU with AVX-512 the library's
panels run 8 rows over three panels in 16-lane vectors, a build for x86-64-v3 (AVX2 + FMA, what
an AVX2-only host builds) 6 rows over one panel in 8-lane vectors. Every output element is one
chain of FMAs over k in both, so the projections, and every test that holds them to F.linear or
to transformers, are the same on both ISAs. Shapes cover each tail: row blocks cut short, an
odd number of panels, a last panel of fewer than 16 columns alone and inside a pair, the
strided rows and the in-place add of a LoRA expand into a column slice. RMSNorm (its vectorised
sums held to 256-bit vectors: kernels/cpu/__init__.py X86_FLAGS) is the same on both too."""

import platform
import textwrap
from pathlib import Path

import pytest
import torch
from floors import assert_as_exact_as
from native_builds import computed

from rollout_kernels import cpu as native
from rollout_kernels.cpu import linear as native_linear

AVX512 = "avx512f" in native._cpu_features().split()  # what -march=native builds for

# (rows, outputs, inputs): outputs 16 (one panel), 24 (a pair, the second partial), 40 (a pair
# and a partial single), 300 (19 panels, the last of 12 columns), 64 (two full pairs)
SHAPES = [(1, 16, 96), (5, 24, 7), (11, 40, 33), (12, 300, 96), (13, 64, 130), (25, 300, 40),
          (130, 40, 96), (7, 40, 300)]  # k = 300: three chunks of 128
# On 3 threads: 3 panels, one each (the last of 1 or 8 columns); 19 in runs of 6-7
THREE_THREADS = [(9, 33, 70), (9, 40, 70), (9, 300, 70)]

COMPUTE = """
    import sys
    import torch
    from rollout_kernels.cpu import linear
    assert linear.invariant_supported(torch.device("cpu")), "no panels in this build"
    out = []
    for m, n, k in SHAPES:
        g = torch.Generator().manual_seed(m * n + k)
        w, x = torch.randn(n, k, generator=g), torch.randn(m, k + 3, generator=g)[:, :k]
        packed = linear.pack_panels(w)
        y = linear.linear(x, packed, n)
        wide = torch.randn(m, n + 20, generator=g)
        linear.linear_add(x, packed, wide[:, 5:5 + n], 0.37)
        out.append((y, wide))
    torch.set_num_threads(3)  # runs of panels split 3 ways, and fewer panels than threads
    for m, n, k in THREE_THREADS:
        g = torch.Generator().manual_seed(n)
        w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
        packed, wide = linear.pack_panels(w), torch.randn(m, n + 20, generator=g)
        linear.linear_add(x, packed, wide[:, 5:5 + n], 0.37)
        out.append((linear.linear(x, packed, n), wide))
    from rollout_kernels.cpu import norm_rope
    norms = []
    for rows, dim in [(3, 64), (7, 576), (5, 1001)]:  # 1001: a tail past every lane count
        g = torch.Generator().manual_seed(rows * dim)
        x, d = (torch.randn(rows, dim, generator=g) * 3 for _ in range(2))
        w = torch.randn(dim, generator=g) * 3
        norms.append((norm_rope.rms_norm(x, w, 1e-6), *norm_rope.add_rms_norm(x, d, w, 1e-5)))
    torch.save((out, norms), sys.argv[1])
"""


def compute(path: Path, **env) -> list:
    return computed(f"SHAPES = {SHAPES!r}\nTHREE_THREADS = {THREE_THREADS!r}\n"
                    + textwrap.dedent(COMPUTE), path, **env)


@pytest.mark.skipif(not AVX512, reason="needs a CPU with AVX-512 to run both blockings")
@pytest.mark.skipif(not native_linear.supported(torch.device("cpu"), torch.float32),
                    reason="this host's library has no panels")
def test_avx512_and_avx2_panels_give_the_same_bits(tmp_path):
    wide, norms = compute(tmp_path / "native.pt")  # this host's build: the 512-bit blocking
    narrow, norms2 = compute(tmp_path / "avx2.pt", ROLLOUT_CACHE=str(tmp_path / "cache"),
                             ROLLOUT_NATIVE_MARCH="x86-64-v3")
    for a, b in zip(norms, norms2, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    # The 512-bit loop in chunks of 32 inputs (every shape but k = 7 cut, k = 300 in 10): the
    # chains go on through y, so whichever chunking a CPU's build takes (linear.c K_CHUNK_512:
    # whole k on a Zen 4, 128 elsewhere) gives the same bits; and so do other register blocks
    # (ROW_BLOCK_512 rows x PANELS_512 panels: 8 x 3 by default; 12 x 2 and 6 x 4 have their
    # own tails, a group of 4 panels cut short at 40 and 300 outputs).
    variants = [compute(tmp_path / f"v{i}.pt", ROLLOUT_CACHE=str(tmp_path / f"cache{i}"),
                        ROLLOUT_NATIVE_CFLAGS=flags)[0]
                for i, flags in enumerate(["-DK_CHUNK_512=32",
                                           "-DROW_BLOCK_512=12 -DPANELS_512=2",
                                           "-DROW_BLOCK_512=6 -DPANELS_512=4 -DK_CHUNK_512=64"])]
    for i, (m, n, k) in enumerate(SHAPES + THREE_THREADS):
        y, added = wide[i]
        for other in [narrow, *variants]:
            assert torch.equal(y, other[i][0]) and torch.equal(added, other[i][1]), (m, n, k)
    # and the results are the projections' (the bits are not all zero or garbage)
    g = torch.Generator().manual_seed(12 * 300 + 96)
    w, x = torch.randn(300, 96, generator=g), torch.randn(12, 99, generator=g)[:, :96]
    assert_as_exact_as(wide[3][0], x.double() @ w.double().T, x @ w.T, "panels' projection")


@pytest.mark.skipif(not native_linear.supported(torch.device("cpu"), torch.float32),
                    reason="this host's library has no panels on intrinsics")
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="x86-64 builds")
def test_the_portable_panels_give_the_intrinsics_bits_where_they_contract(tmp_path):
    """linear.c's portable C (no AVX2: ARM, older x86), built where the CPU has FMA as an
    ARM build has it: the compiler contracts each multiply-add into one, so every output
    element is the intrinsics' chain of FMAs and the bits are this host's."""
    native_out, _ = compute(tmp_path / "native.pt")
    portable, _ = compute(tmp_path / "portable.pt", ROLLOUT_CACHE=str(tmp_path / "cache"),
                          ROLLOUT_NATIVE_MARCH="x86-64", ROLLOUT_NATIVE_CFLAGS="-mfma")
    for shape, (y, added), (y2, added2) in zip(SHAPES + THREE_THREADS, native_out, portable,
                                               strict=True):
        assert torch.equal(y, y2) and torch.equal(added, added2), shape
