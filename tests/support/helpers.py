"""Driving the engine step by step with invariant checks."""

from rollout import Engine


def run_checked(engine: Engine, prompts, params) -> list:
    """generate() through the streaming API, calling check_invariants() after every step."""
    if not isinstance(params, list):
        params = [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.check_invariants()
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            done[out.request_id] = out
        engine.check_invariants()
    return [done[i] for i in ids]


def samples(outs) -> list[list[list[int]]]:
    return [[s.token_ids for s in o.samples] for o in outs]
