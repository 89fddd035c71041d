"""Benchmarks run end to end here with tiny shapes on the CPU (Triton's interpreter, the CUDA
graphs' stand-in), so a Python-level bug in them surfaces in CI and not in a short GPU session
or a long run: bench/triton_kernels.py --smoke (every section), bench/decode_step.py,
bench/graph_capture.py, bench/history_lookup.py."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECTIONS = ("check q_lens=", "== decode (", "== prefill / extend (", "== tile sweep (",
            "== shared prefix: ", "== sampler: ")


def test_bench_kernels_smoke():
    # No visible GPU: the run takes the CPU path (perf_counter timing, interpreter) everywhere.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "bench/triton_kernels.py", "--smoke"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for header in SECTIONS:
        assert header in out, f"no {header!r} in:\n{out}"
    lines = out.splitlines()
    assert not [line for line in lines if "WRONG" in line or "failed:" in line], out
    sampler = [line for line in lines if "tokens equal:" in line]
    assert len(sampler) == 3 and all(line.endswith("tokens equal: True") for line in sampler), out


@pytest.mark.skipif(shutil.which("cc") is None, reason="the FMA probe is built with cc")
def test_bench_decode_step_smoke():
    """bench/decode_step.py on one layer and four samples: its replay of the runner and the FMA
    peak probe it measures the matmuls against still run (it once broke unseen)."""
    proc = subprocess.run([sys.executable, "bench/decode_step.py", "--layers", "1", "--prompts",
                           "2", "--n", "2", "--prefix-len", "10", "--prompt-len", "14",
                           "--decoded", "4", "--repeat", "1", "--engine-steps", "1",
                           "--profile-at", "0"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "of the FMA peak" in proc.stdout and "matmul only" in proc.stdout, proc.stdout


def test_bench_graph_capture_smoke():
    """bench/graph_capture.py on the graphs' CPU stand-in: one capture per bucket at first use
    and again after each sleep (asserted by the script), a row per bucket."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "bench/graph_capture.py", "--model-shape", "tiny",
                           "--buckets", "1,2", "--repeats", "1", "--steps", "2"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2 and "all 2 buckets" in proc.stdout, proc.stdout


def test_bench_history_lookup_smoke():
    """bench/history_lookup.py on a small history: it drives the history and the n-gram search
    through their own calls, so an API change there breaks it here first."""
    proc = subprocess.run([sys.executable, "bench/history_lookup.py", "--epochs", "1",
                           "--prompts", "2", "--n", "2", "--repeat", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "us a sample" in proc.stdout and "history / n-gram" in proc.stdout, proc.stdout
