"""Ranks of a tensor-parallel engine that go apart.

Requests queued with add_request (the streaming API, no agreement of its own) that differ
across the ranks of a tensor-parallel engine: their seed, temperature or max_tokens. The ranks
run the same tokens through the same batch, so the per-step batch check alone had passed them:
each rank sampled its own token (silently different outputs; a sample's last token feeds no
forward, so no later step saw it) or stopped at its own length (the longer ranks then waited
forever for the others' next step). Now every rank refuses the first step that runs such a
request, and once the caller aborts it the engine serves as one rank does.

A rank that never joins a collective of the engine's group (it failed on its own): the others
wait as long as the trainer's world does (init_process_group's timeout), not torch's default
for a new group (30 minutes on gloo, 10 on NCCL).

Calls whose arguments or state differ per rank (`calls_apart`, one launch, one engine): rollout()
request_ids of each rank's own, sleep() at a level of each rank's own, score() on a rank whose
weights are incomplete, a DTensor update failing on one rank before its first exchange, Ctrl-C
on one rank mid-forward. Each had left the ranks apart (groups carried forever, a rank waiting
until the world's timeout, gloo aborting the process at the retry); now every rank refuses or
fails together and the engine then serves as one rank does.

Run as `python test_tp_ranks_apart.py SCENARIO OUT_DIR` it is the launcher: 2 forked gloo
ranks (tests/support/fork_ranks.py) running `SCENARIO` (a function of this file), each
writing OUT_DIR/rank<i>.json."""

import datetime
import json
import os
import subprocess
import sys
import time

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
PROMPT = [1, 2, 3, 4]
WORLD = 2
# Each case's params on rank r (all sampled from the same logits on every rank).
CASES = {"seed": lambda r: dict(n=2, max_tokens=1, seed=r),
         "temperature": lambda r: dict(max_tokens=1, temperature=1.0 + r, seed=0),
         "max_tokens": lambda r: dict(max_tokens=2 + r, temperature=0)}
AGREED = dict(n=2, max_tokens=3, seed=7)
# Each scenario's world timeout (init_process_group's): long enough for a loaded 2-core
# machine's ranks to build engines while another waits; for a wait that must time out, short.
TIMEOUTS = {"streamed": datetime.timedelta(seconds=60),
            "never_joins": datetime.timedelta(seconds=3),
            "calls_apart": datetime.timedelta(seconds=60)}


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


def _launch(scenario: str, out_dir) -> list:
    """`scenario` run on 2 forked ranks (this file as the launcher); each rank's results."""
    run = subprocess.run([sys.executable, os.path.abspath(__file__), scenario, str(out_dir)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _rank(rank: int, world: int, port: int, scenario: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=TIMEOUTS[scenario])
    results = globals()[scenario](rank, out_dir)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def streamed(rank: int, out_dir: str) -> dict:
    from rollout import SamplingParams

    engine = _engine(WORLD)
    results = {}
    for name, params in CASES.items():
        try:
            results[name] = _finish(engine, PROMPT, SamplingParams(**params(rank)))
        except RuntimeError as e:
            results[name] = "refused" if "run different requests" in str(e) else repr(e)
        engine.abort_all()
        engine.check_invariants()
    results["after"] = _finish(engine, PROMPT, SamplingParams(**AGREED))
    return results


def never_joins(rank: int, out_dir: str) -> dict:
    """Rank 0 all-reduces on the engine's group, rank 1 never does (it stays alive, in no
    collective, until rank 0 is through or 10 timeouts have passed): rank 0 must time out."""
    import torch
    import torch.distributed as dist

    from rollout.parallel import tensor_parallel

    tp = tensor_parallel(WORLD)
    done = os.path.join(out_dir, "rank0.done")
    if rank == 1:
        deadline = time.monotonic() + 10 * TIMEOUTS["never_joins"].total_seconds()
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        return {}
    try:
        dist.all_reduce(torch.zeros(1), group=tp.group)
        result = "joined"
    except RuntimeError as e:
        result = "timed out" if "Timed out" in str(e) else repr(e)
    open(done, "w").close()
    return {"result": result}


def _tokens(outs) -> list[list[list[int]]]:
    return [[s.token_ids for s in o.samples] for o in outs]


def _refused(call) -> str:
    """"refused" where the call raised saying the ranks of the engine differ (on every rank:
    the difference is in the call's arguments)."""
    try:
        call()
        return "ok"
    except RuntimeError as e:
        return "refused" if "ranks of one engine" in str(e) else repr(e)


def request_ids_apart(engine, rank: int) -> dict:
    """rollout(request_ids=) of each rank's own: refused before anything is queued."""
    from rollout import SamplingParams

    params = SamplingParams(**AGREED)
    return {"refused": _refused(lambda: engine.rollout([PROMPT], params,
                                                       request_ids=[f"id{rank}"])),
            "carried": engine.carried,
            "after": _tokens(engine.rollout([PROMPT], params, request_ids=["same"]))}


def sleep_levels_apart(engine, rank: int) -> dict:
    """sleep(1 + rank): refused on every rank, every rank left awake."""
    refused = _refused(lambda: engine.sleep(1 + rank))
    return {"refused": refused, "state": [engine.sleep_level, engine.needs_weights]}


def readiness_apart(engine, rank: int) -> dict:
    """score() where rank 1's weights are incomplete (ranks left apart, as a failure handled
    on one rank only would leave them): that rank refuses as one engine does, the others with
    it, not waiting for it in the call's agreement. Then the same scores as before."""
    before = engine.score([PROMPT])[0].logprobs
    engine.colocation.weights_missing = rank == 1
    try:
        engine.score([PROMPT])
        result = "ok"
    except RuntimeError as e:
        result = "incomplete" if "weights are incomplete" in str(e) else \
            "refused" if "ranks of one engine" in str(e) else repr(e)
    engine.colocation.weights_missing = False
    return {"result": result, "after": engine.score([PROMPT])[0].logprobs == before}


def dtensor_copy_fails(engine, rank: int) -> dict:
    """An update from DTensor shards (the embedding a plain tensor, read first) whose first copy
    fails on rank 1, before that rank's first exchange: every rank fails at once (rank 0 had
    waited in the exchange for the world's timeout), then a complete update serves the new
    weights."""
    import torch
    from models import tiny_model
    from tp_scenarios import world_sharded

    from rollout import SamplingParams

    def source():
        model = world_sharded(tiny_model("llama", 1), 0)
        embedding = model.model.embed_tokens
        embedding.weight = torch.nn.Parameter(embedding.weight.full_tensor())
        return model

    stack = engine.stack
    real = stack.model.load_weights

    def failing(*args, **kwargs):
        stack.model.load_weights = real
        raise RuntimeError("copy")
    if rank == 1:
        stack.model.load_weights = failing
    try:
        engine.update_weights(source(), bucket_bytes=4096)
        result = "ok"
    except RuntimeError as e:
        result = "other rank" if "failed on another rank" in str(e) else "copy" if \
            "a copy failed" in str(e) else repr(e)
    needs = engine.needs_weights
    engine.update_weights(source(), bucket_bytes=4096)
    return {"result": result, "needs_weights": needs,
            "after": _tokens(engine.generate([PROMPT], SamplingParams(**AGREED)))}


def interrupted_mid_forward(engine, rank: int) -> dict:
    """A real SIGINT on rank 1 as a forward starts, held through the forward's collectives.
    In the first of a call's three steps: every rank stops at the next step's check (rank 1
    KeyboardInterrupt, the others RuntimeError). In generate()'s last: the other ranks return,
    rank 1 raises as its call ends. In rollout()'s last: every rank stops before handing the
    group out, which stays carried on every rank. Each time, per rank: what was raised, the
    groups carried, and the retry's tokens (to equal an uninterrupted call's)."""
    import signal

    from rollout import SamplingParams

    # Python's own handler, whatever this process inherited: a shell's background job starts
    # with SIGINT ignored, and Python then installs no handler (the signal did nothing).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    params = SamplingParams(**AGREED)  # max_tokens=3: 3 steps, the first computing the prompt
    calls = {"generate": lambda: engine.generate([PROMPT], params),
             "rollout": lambda: engine.rollout([PROMPT], params)}
    retries = {"generate": calls["generate"], "rollout": engine.rollout}
    runner = engine.runner
    real = runner.run
    results = {}
    for call, at in (("generate", 1), ("generate", 3), ("rollout", 3)):
        forwards = []

        def interrupting(inputs):
            forwards.append(1)
            if len(forwards) == at:
                runner.run = real
                signal.raise_signal(signal.SIGINT)
            return real(inputs)
        if rank == 1:
            runner.run = interrupting
        try:
            calls[call]()
            result = "ok"
        except KeyboardInterrupt:
            result = "KeyboardInterrupt"
        except RuntimeError as e:
            result = "other rank" if "was interrupted" in str(e) else repr(e)
        engine.check_invariants()
        results[f"{call} {at}"] = [result, len(engine.carried), _tokens(retries[call]())]
    # Streaming: the interrupt in the last step's forward stops every rank before step()
    # hands the output out, which the next step() hands out on every rank (the interrupted
    # rank alone had kept it).
    forwards = []

    def interrupting_last(inputs):
        forwards.append(1)
        if len(forwards) == 3:
            runner.run = real
            signal.raise_signal(signal.SIGINT)
        return real(inputs)
    if rank == 1:
        runner.run = interrupting_last
    engine.add_request(PROMPT, params, request_id="streamed")
    got, result = [], "ok"
    try:
        while not got:
            got = engine.step()
    except KeyboardInterrupt:
        result = "KeyboardInterrupt"
    except RuntimeError as e:
        result = "other rank" if "was interrupted" in str(e) else repr(e)
    results["step 3"] = [result, [o.request_id for o in got or engine.step()]]
    return results


CALLS_APART = (request_ids_apart, sleep_levels_apart, readiness_apart, interrupted_mid_forward,
               dtensor_copy_fails)


def calls_apart(rank: int, out_dir: str) -> dict:
    engine = _engine(WORLD)
    return {part.__name__: part(engine, rank) for part in CALLS_APART}


def test_calls_apart_across_ranks_fail_on_every_rank_then_serve(tmp_path):
    sys.path.insert(0, SUPPORT)
    from models import tiny_model

    from rollout import Engine, EngineConfig, SamplingParams

    ranks = _launch("calls_apart", tmp_path)
    params = SamplingParams(**AGREED)
    one_rank = _tokens(_engine(1).generate([PROMPT], params))
    updated = _tokens(Engine(tiny_model("llama", 1), EngineConfig(
        kv_cache_tokens=1024, max_model_len=64)).generate([PROMPT], params))
    for r, got in enumerate(ranks):
        assert got == {
            "request_ids_apart": {"refused": "refused", "carried": [], "after": one_rank},
            "sleep_levels_apart": {"refused": "refused", "state": [0, False]},
            "readiness_apart": {"result": "incomplete" if r == 1 else "refused",
                                "after": True},
            "interrupted_mid_forward": {
                "generate 1": ["KeyboardInterrupt" if r == 1 else "other rank", 0, one_rank],
                "generate 3": ["KeyboardInterrupt" if r == 1 else "ok", 0, one_rank],
                "rollout 3": ["KeyboardInterrupt" if r == 1 else "other rank", 1, one_rank],
                "step 3": ["KeyboardInterrupt" if r == 1 else "other rank", ["streamed"]]},
            "dtensor_copy_fails": {"result": "copy" if r == 1 else "other rank",
                                   "needs_weights": True, "after": updated}}, (r, got)


def test_streamed_requests_that_differ_across_ranks_are_refused(tmp_path):
    sys.path.insert(0, SUPPORT)
    from rollout import SamplingParams

    ranks = _launch("streamed", tmp_path)
    one_rank = _finish(_engine(1), PROMPT, SamplingParams(**AGREED))
    for r, got in enumerate(ranks):
        assert got == {**{name: "refused" for name in CASES}, "after": one_rank}, (r, got)


def test_the_engines_group_waits_for_a_rank_as_long_as_the_world_does(tmp_path):
    """(It had waited torch's 30 minutes; rank 0 then saw rank 1 leave, not a timeout.)"""
    assert _launch("never_joins", tmp_path)[0] == {"result": "timed out"}


if __name__ == "__main__":
    sys.path[:0] = [SUPPORT, os.path.dirname(SUPPORT)]
    import torch
    from fork_ranks import fork_ranks
    from models import tiny_model

    torch.set_num_threads(1)
    tiny_model("llama")  # transformers' Llama modules imported once, before the fork
    sys.exit(fork_ranks(_rank, WORLD, tuple(sys.argv[1:3]), timeout=240))
