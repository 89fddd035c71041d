"""Requests queued with add_request (the streaming API, no agreement of its own) that differ
across the ranks of a tensor-parallel engine: their seed, temperature or max_tokens. The ranks
run the same tokens through the same batch, so the per-step batch check alone had passed them:
each rank sampled its own token (silently different outputs; a sample's last token feeds no
forward, so no later step saw it) or stopped at its own length (the longer ranks then waited
forever for the others' next step). Now every rank refuses the first step that runs such a
request, and once the caller aborts it the engine serves as one rank does.

Run as `python test_tp_streamed_requests.py OUT_DIR` it is the launcher: 2 forked gloo ranks
(tests/support/fork_ranks.py), each writing OUT_DIR/rank<i>.json."""

import json
import os
import subprocess
import sys

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
PROMPT = [1, 2, 3, 4]
WORLD = 2
# Each case's params on rank r (all sampled from the same logits on every rank).
CASES = {"seed": lambda r: dict(n=2, max_tokens=1, seed=r),
         "temperature": lambda r: dict(max_tokens=1, temperature=1.0 + r, seed=0),
         "max_tokens": lambda r: dict(max_tokens=2 + r, temperature=0)}
AGREED = dict(n=2, max_tokens=3, seed=7)


def _engine(tp: int):
    from models import tiny_model

    from rollout import Engine, EngineConfig

    return Engine(tiny_model("llama", 0), EngineConfig(kv_cache_tokens=1024, max_model_len=64,
                                                       tensor_parallel_size=tp))


def _finish(engine, prompt, params) -> list[list[int]]:
    engine.add_request(prompt, params)
    outs = []
    while not outs:
        outs = engine.step()
    return [s.token_ids for s in outs[0].samples]


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    from rollout import SamplingParams

    # A rank left waiting for a step the others never run fails after this, not never.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    engine = _engine(world)
    results = {}
    for name, params in CASES.items():
        try:
            results[name] = _finish(engine, PROMPT, SamplingParams(**params(rank)))
        except RuntimeError as e:
            results[name] = "refused" if "run different requests" in str(e) else repr(e)
        engine.abort_all()
        engine.check_invariants()
    results["after"] = _finish(engine, PROMPT, SamplingParams(**AGREED))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def test_streamed_requests_that_differ_across_ranks_are_refused(tmp_path):
    sys.path.insert(0, SUPPORT)
    from rollout import SamplingParams

    run = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    one_rank = _finish(_engine(1), PROMPT, SamplingParams(**AGREED))
    for r, got in enumerate(ranks):
        assert got == {**{name: "refused" for name in CASES}, "after": one_rank}, (r, got)


if __name__ == "__main__":
    sys.path[:0] = [SUPPORT, os.path.dirname(SUPPORT)]
    import torch
    from fork_ranks import fork_ranks
    from models import tiny_model

    torch.set_num_threads(1)
    tiny_model("llama")  # transformers' Llama modules imported once, before the fork
    sys.exit(fork_ranks(_rank, WORLD, (sys.argv[1],), timeout=240))
