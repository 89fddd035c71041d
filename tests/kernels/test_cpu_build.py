"""The C kernels' build (kernels/cpu/__init__.py) as a shared cache sees it: one build per host
however many processes start at once, a library every user can load, no temporaries left by
a build that died, $CC with arguments, a key that changes with the compiler and the CPU; and
the portable build: for plain x86-64 (no AVX2, no FMA) the kernels without a portable path
turn off one by one, saying why, and the rest pass their tests."""

import os
import platform
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout_kernels import cpu as native

ROOT = Path(__file__).parents[2]
CC = shutil.which("cc") or shutil.which("gcc")
CLANG = shutil.which("clang")
X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler here")
# The build's locking, permissions, clean-up and $CC handling do not depend on -march: the
# tests of them build the portable x86-64 library, which compiles in 3 s against 6 s for this
# Zen 3's native one (no intrinsics paths).
QUICK_BUILD = dict(ROLLOUT_NATIVE_MARCH="x86-64") if X86 else {}


def run(code: str, cache: Path, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    """`code` in a fresh Python whose kernels build into `cache`."""
    full = dict(os.environ, ROLLOUT_CACHE=str(cache), **env)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: int = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out


LOAD = """
    import warnings
    warnings.simplefilter("ignore")
    from rollout_kernels import cpu
    lib = cpu.library()
    print(lib is not None, sorted(lib.missing) if lib is not None else None)
"""


def counting_compiler(tmp_path: Path) -> tuple[str, Path]:
    """A cc that logs each link (one per build) before running the real one."""
    log = tmp_path / "links.log"
    script = tmp_path / "cc"
    script.write_text(f'#!/bin/sh\ncase " $* " in *" -shared "*) echo link >> "{log}";; esac\n'
                      f'exec "{CC}" "$@"\n')
    script.chmod(0o755)
    return str(script), log


def test_processes_starting_together_build_once(tmp_path):
    cc, log = counting_compiler(tmp_path)
    procs = [run(LOAD, tmp_path / "cache", CC=cc, **QUICK_BUILD) for _ in range(3)]
    assert [finish(p).split()[0] for p in procs] == ["True"] * 3
    assert log.read_text().split() == ["link"]
    finish(run(LOAD, tmp_path / "cache", CC=cc, **QUICK_BUILD))  # found in the cache: no build
    assert log.read_text().split() == ["link"]


def test_the_library_is_readable_by_every_user_and_no_partial_build_stays(tmp_path):
    folder = tmp_path / "cache" / "native"
    folder.mkdir(parents=True)
    stale = folder / "tmpdead.partial"  # what a build killed before its rename leaves
    stale.write_bytes(b"half a library")
    (folder / "objsdead.partial").mkdir()
    assert finish(run(LOAD, tmp_path / "cache", **QUICK_BUILD)).split()[0] == "True"
    libraries = list(folder.glob("rollout_native_*.so"))
    assert len(libraries) == 1
    assert stat.S_IMODE(libraries[0].stat().st_mode) & 0o044 == 0o044
    assert not stale.exists()
    assert list(folder.glob("*.partial")) == []


def test_cc_is_split_like_a_shell_word_list(tmp_path):
    """`CC="ccache gcc"`-style values: a launcher and the compiler (here `env cc`)."""
    out = finish(run(LOAD, tmp_path / "cache", CC=f"env {CC}", **QUICK_BUILD))
    assert out.split()[0] == "True"
    assert native.compiler() is not None
    os.environ["CC"], before = f"env {CC} -O2", os.environ.get("CC")
    try:
        assert native.compiler() == ["env", CC, "-O2"]
    finally:
        os.environ.pop("CC") if before is None else os.environ.__setitem__("CC", before)


def test_the_key_follows_the_compiler_version_and_the_cpu(monkeypatch):
    here = Path(native.__file__).parent
    sources = [here / n for n in native.SOURCES]
    headers = [here / n for n in native.HEADERS]
    path = native.library_path([CC], sources, headers)
    monkeypatch.setattr(native, "_cpu_features", lambda: "flags : fpu sse2")
    other_cpu = native.library_path([CC], sources, headers)
    monkeypatch.setattr(native, "_version", lambda cc: "gcc (Other) 99.0")
    other_compiler = native.library_path([CC], sources, headers)
    assert len({path, other_cpu, other_compiler}) == 3


def test_features_are_read_on_arm_too(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(
        cpuinfo if p == "/proc/cpuinfo" else p, *a, **k))
    assert "asimd" in native._cpu_features() and "sve" in native._cpu_features()


@pytest.mark.skipif(not X86, reason="x86-64 baseline builds")
def test_a_build_without_avx2_turns_off_only_the_kernels_that_need_it(tmp_path):
    """The Gumbel sampler goes off; the projections' panels run on their portable C (the
    batch-invariant mode's), which the default mode does not choose (untuned: oneDNN's)."""
    out = finish(run("""
        import warnings
        import torch
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            from rollout_kernels import cpu
            from rollout_kernels.cpu import linear
            lib = cpu.library()
        print(sorted(lib.missing))
        print(cpu.has("rms_norm_f32", "rotary_f32", "silu_mul_f32", "paged_attention_f32"))
        cpu_device = torch.device("cpu")
        print(linear.invariant_supported(cpu_device), linear.supported(cpu_device, torch.float32))
        print(cpu.missing_reason("gumbel_argmax_f32"))
        print(*[str(w.message) for w in seen], sep="|")
    """, tmp_path / "cache", ROLLOUT_NATIVE_MARCH="x86-64"))
    missing, portable, panels, reason, warned = out.splitlines()
    assert missing == str(sorted(native.NEEDS_AVX2_FMA | native.NEEDS_AMX))
    assert portable == "True"
    assert panels == "True False"
    assert "AVX2 and FMA" in reason and "x86-64" in reason
    assert "AVX2 and FMA" in warned and "gumbel_argmax_f32" in warned
    assert "amx" not in warned  # a faster path only: its absence warns no one


@pytest.mark.skipif(not X86, reason="x86-64 builds")
def test_avx2_without_fma_builds(tmp_path):
    """The intrinsics paths need both: -mavx2 alone takes the portable paths, not a failed
    build."""
    out = finish(run(LOAD, tmp_path / "cache", ROLLOUT_NATIVE_MARCH="x86-64",
                     ROLLOUT_NATIVE_CFLAGS="-mavx2 -mno-fma"))
    assert out.split()[0] == "True"


@pytest.mark.skipif(not X86, reason="x86-64 baseline builds")
def test_the_portable_paths_pass_the_native_tests(tmp_path):
    """What ARM and old x86 run: the C kernels with their portable paths (no intrinsics), held
    to the same tests (the panels' row invariance too); the Gumbel sampler skips, saying
    why."""
    tests = ["tests/models/test_native_norm_rope.py", "tests/models/test_native_silu_mul.py",
             "tests/sample/test_native_gumbel.py", "tests/models/test_packed_linear.py",
             "tests/attention/test_native_attention.py::test_kernel_matches_float64_reference",
             "tests/attention/test_native_attention.py::test_agrees_with_the_torch_paths_on_every_layer",
             "tests/attention/test_invariant_attention.py", "tests/engine/test_batch_invariant.py"]
    env = dict(os.environ, ROLLOUT_CACHE=str(tmp_path / "cache"), ROLLOUT_NATIVE_MARCH="x86-64")
    # the Triton cases of those files read no C code: they ran in the suite already
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "-k", "not triton", *tests], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout
    skips = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips and all("AVX2 and FMA" in line for line in skips), skips


@pytest.mark.skipif(CLANG is None, reason="no clang here (Debian: apt-get install clang)")
def test_a_clang_build_gives_the_same_bits(tmp_path):
    """clang contracts multiply-adds into FMAs by default (GCC too, under -ffp-contract=fast):
    rotary is bit-for-bit torch's only without contraction, which its file's own flag keeps
    whatever the compiler's default or the caller's flags (here -ffp-contract=fast added: 5
    rotary cases fail without that flag). The tests that hold kernels to exact bits (rotary,
    the Gumbel tokens, the operators, the invariant attention) pass on a clang build, whose
    OpenMP is torch's libgomp, not a second runtime."""
    tests = ["tests/models/test_native_norm_rope.py", "tests/sample/test_native_gumbel.py",
             "tests/models/test_packed_linear.py", "tests/attention/test_invariant_attention.py",
             "tests/kernels/test_cpu_ops.py"]
    cache = tmp_path / "cache"
    env = dict(os.environ, ROLLOUT_CACHE=str(cache), CC=CLANG,
               ROLLOUT_NATIVE_CFLAGS="-ffp-contract=fast")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-k", "not triton", *tests], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    (library,) = (cache / "native").glob("rollout_native_*.so")
    image = library.read_bytes()  # the compiler's name in .comment, the runtimes in .dynstr
    assert b"clang version" in image and b"libgomp.so.1" in image and b"libomp.so" not in image
