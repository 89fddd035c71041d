"""A rollout leaves the garbage collector little to do: every tracked object a step keeps alive
through a young collection brings the next full one nearer, and a full one walks the whole
trainer process (~400K objects after importing torch and transformers: 0.19 s on a 2-core CPU,
a third of a tiny model's rollout time before the step's per-sequence data became tuples and
shared empties; docs/benchmarks.md, "The garbage collector").

Counted, not timed: the young collections a rollout of 512 samples triggers, times the
allocation threshold that triggers one, per token generated, is how many tracked objects the
engine allocates per token beyond those it frees at once. Measured on this test's rollout
(CPython 3.11, torch 2.13): 8.9 per token; 21.1 before (a list per field of each sampled
token's `Emitted`, a copy of it per verdict, a list per `ScheduledSeq.draft`). The bound, 12,
sits between the two."""

import gc
import random

import pytest
import torch
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams

MAX_TRACKED_PER_TOKEN = 12


def test_a_rollout_allocates_few_tracked_objects_per_token():
    if not gc.isenabled():
        pytest.skip("the garbage collector is off in this process: no collections to count")
    torch.manual_seed(0)
    engine = Engine(tiny_model("qwen2"), EngineConfig(kv_cache_tokens=16384, max_model_len=64,
                                                      max_num_seqs=512))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randrange(3, 12))] for _ in range(64)]
    params = SamplingParams(n=8, max_tokens=24, temperature=1.0, ignore_eos=True,
                            logprobs=True)
    engine.generate(prompts[:2], params)  # first-call set-up is not the steady state
    collections = []

    def count(phase: str, info: dict) -> None:
        if phase == "stop":
            collections.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        outs = engine.generate(prompts, params)
    finally:
        gc.callbacks.remove(count)
    tokens = sum(len(s.token_ids) for o in outs for s in o.samples)
    assert tokens == 64 * 8 * 24
    per_token = len(collections) * gc.get_threshold()[0] / tokens
    assert per_token <= MAX_TRACKED_PER_TOKEN, (per_token, collections.count(2))
