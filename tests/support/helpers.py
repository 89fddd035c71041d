"""Driving the engine step by step with invariant checks; pinning what its steps cost."""

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


def pin_step_cost(engine: Engine, fixed: float, per_position: float) -> Engine:
    """Adaptive speculation weighs drafts against the step cost the engine measures on its own
    clock (rollout/spec/cost.py): a test that counts drafts would depend on how loaded the
    machine is. This gives the engine the cost line of a machine whose step costs `fixed` +
    `per_position` x positions seconds and stops it observing its own steps."""
    for positions in range(1, 200, 7):
        engine.speculator.cost.observe(positions, fixed + per_position * positions)
    engine.speculator.observe_step = lambda positions, seconds: None
    return engine
