"""Data parallel x tensor parallel in the recipes: `tensor_parallel_size` k over W processes runs
W / k engines of k ranks (CPU, gloo, forked by tests/support/recipes_tp_launch.py). The ranks of one
engine get the same prompts and return the same samples, engines get different prompts; the
TRL trainer's ranks get their own rows from TRL and the engine generates for both."""

import json
import math
import os
import subprocess
import sys
from collections import Counter

import pytest
from test_recipes import check_steps, read_jsonl, write_config

from rollout_recipes.grpo import main
from rollout_recipes.run.config_file import load_config

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")


def launch(tmp_path, world: int, *args: str) -> list[dict]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", WANDB_MODE="offline",
               WANDB_SILENT="true", TRL_EXPERIMENTAL_SILENCE="1")
    run = subprocess.run([sys.executable, os.path.join(SUPPORT, "recipes_tp_launch.py"),
                          str(tmp_path), str(world), "--config", write_config(tmp_path),
                          "--tensor_parallel_size", "2", *args],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, got in enumerate(ranks):
        assert got["calls"]["tp"] == [r % 2, 2], f"rank {r} is not rank {r % 2} of 2"
    return ranks


def check_history(tmp_path) -> None:
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    history = [r for r in rows if "step" in r]
    check_steps(history)
    for row in history:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row


def test_custom_loop_four_processes_two_engines(tmp_path):
    ranks = launch(tmp_path, 4)
    calls = [r["calls"]["engine"] for r in ranks]
    # Each engine's two ranks asked and answered alike.
    assert calls[0] == calls[1] and calls[2] == calls[3]
    # Greedy held-out scoring (1 sample), 2 steps (4 samples per prompt), scoring again: the
    # 16 held-out prompts split across the 2 engines, not the 4 ranks; engines never overlap.
    for mine, other, n, count in zip(calls[0], calls[2], (1, 4, 4, 1), (8, 4, 4, 8),
                                     strict=True):
        assert not {tuple(p) for p in mine["prompts"]} & {tuple(p) for p in other["prompts"]}
        assert [len(s) for s in mine["samples"]] == [n] * count
    check_history(tmp_path)
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["summary"]["processes"] == 4


def test_trl_two_processes_one_engine(tmp_path):
    ranks = launch(tmp_path, 2, "--trainer", "trl")
    engine = [r["calls"]["engine"] for r in ranks]
    assert engine[0] == engine[1]  # one engine: both ranks ran the same requests
    trl = [r["calls"]["trl"] for r in ranks]
    assert len(trl[0]) == len(trl[1]) == 2
    for step in zip(*trl):
        rows = [{tuple(p) for p in rank["prompts"]} for rank in step]
        assert not rows[0] & rows[1]  # TRL gave each rank its own prompts
        # ... and the engine generated for both: each rank kept its own rows' samples.
        (call,) = [c for c in engine[0] if {tuple(p) for p in c["prompts"]} == rows[0] | rows[1]]
        generated = Counter((tuple(p), tuple(s)) for p, samples in
                            zip(call["prompts"], call["samples"]) for s in samples)
        kept = Counter((tuple(p), tuple(c)) for rank in step
                       for p, c in zip(rank["prompts"], rank["completions"]))
        assert kept == generated
    check_history(tmp_path)


def test_tensor_parallel_size_must_divide_the_processes(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 must divide the number of "
                                         "processes, 1"):
        main(["--config", write_config(tmp_path), "--tensor_parallel_size", "2"])
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        load_config(write_config(tmp_path), {"tensor_parallel_size": 0})
    with pytest.raises(ValueError, match="tensor_parallel_size: the calculator task"):
        load_config(write_config(tmp_path), {"tensor_parallel_size": 2, "task": "calculator"})
