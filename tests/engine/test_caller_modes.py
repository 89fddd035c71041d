"""The engine's state does not depend on the autograd mode its caller is in.

An eval script or a trainer's rollout block may build or wake the engine inside
`torch.inference_mode()`. What the engine allocates there and keeps (weights, KV pool and free
list, slot table, RoPE tables, the draft model's) must still be plain tensors: torch refuses the
in-place updates of an inference tensor made outside that mode, which the next step (and the
rollback of that step) or update_weights makes; so must what update_weights allocates.
Reference: the carried runs of test_carry.py, whose uninterrupted run is held to a float64
forward; for updates, an engine built on the final weights.
"""

from __future__ import annotations

import pytest
import torch
from floors import tolerance
from models import tiny_model
from test_carry import all_logprobs, carried_run, exact_gap, lp_gap, tokens, uninterrupted
from test_faults import PARAMS, PROMPTS, TOK, make

MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad,
         "enable_grad": torch.enable_grad}


def assert_resumes_as_uninterrupted(engine, spec: str) -> None:
    """Two sleep/wake cycles (level 1, then level 2 refilled by update_weights) between
    rollouts, outside any mode: every write of a step, a wake-up and an update in place."""
    got = carried_run(engine, 2)
    want = uninterrupted(spec, True)
    assert engine.stats.retracted > 0
    assert tokens(got) == tokens(want)
    assert lp_gap(got, want) <= tolerance(exact_gap(want), all_logprobs(want))


@pytest.mark.parametrize("spec", ["plain", "draft"])
@pytest.mark.parametrize("mode", MODES)
def test_an_engine_built_in_any_mode_runs_outside_it(mode, spec):
    with MODES[mode]():
        caller = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        engine = make(spec, True)
        assert (torch.is_grad_enabled(), torch.is_inference_mode_enabled()) == caller
    assert_resumes_as_uninterrupted(engine, spec)


@pytest.mark.parametrize("spec", ["plain", "draft"])
@pytest.mark.parametrize("carried_kv", ["recompute", "park"])
def test_an_engine_woken_under_inference_mode_runs_outside_it(spec, carried_kv):
    """Woken at level 1 (weights restored from the host) and level 2 (allocated again, then
    filled by update_weights outside the mode), with samples carried across; park: their K/V
    written back into the new pool at wake-up."""
    engine = make(spec, True, carried_kv=carried_kv)
    wake_up = engine.wake_up

    def wake_up_under_inference_mode():
        with torch.inference_mode():
            wake_up()

    engine.wake_up = wake_up_under_inference_mode
    assert_resumes_as_uninterrupted(engine, spec)



def test_an_update_under_inference_mode_leaves_later_updates_outside_it_working():
    """update_weights makes the weights' derived copies anew after a level-2 sleep (here the
    LM head's float32 copy, lm_head_dtype, which later updates rewrite in place): plain under
    inference_mode too. Reference: an engine built on the final weights."""
    def build(model):
        return make("plain", True, model, backend="torch", lm_head_dtype=torch.float32)

    model, other = (tiny_model("qwen2", seed=seed, vocab_size=len(TOK), dtype=torch.bfloat16)
                    for seed in (0, 7))
    engine = build(model)
    engine.sleep(2)
    engine.wake_up()
    with torch.inference_mode():
        engine.update_weights(other)
    engine.update_weights(model)
    got, want = (e.generate(PROMPTS, PARAMS) for e in (engine, build(model)))
    assert ([[(s.token_ids, s.logprobs) for s in o.samples] for o in got]
            == [[(s.token_ids, s.logprobs) for s in o.samples] for o in want])


def test_copies_packed_inside_a_forward_are_updated_in_place_later():
    """Derived copies dropped (a sleep's drop_tables, an update interrupted before packing) are
    made again at their next use, inside the runner's inference mode: they must be plain
    tensors, which the next update rewrites in place outside it (the LM head's float32 copy
    had been an inference tensor there: update_weights failed). Reference: an engine built on
    the final weights."""
    def build(model):
        return make("plain", True, model, backend="torch", lm_head_dtype=torch.float32)

    model, other = (tiny_model("qwen2", seed=seed, vocab_size=len(TOK), dtype=torch.bfloat16)
                    for seed in (0, 7))
    engine = build(model)
    engine.model.drop_tables()
    engine.model.build_tables(engine.device)  # the tables back, the packed copies not yet
    engine.generate(PROMPTS, PARAMS)  # packs the head's copy inside the forward
    engine.update_weights(other)
    engine.update_weights(model)
    got, want = (e.generate(PROMPTS, PARAMS) for e in (engine, build(model)))
    assert ([[(s.token_ids, s.logprobs) for s in o.samples] for o in got]
            == [[(s.token_ids, s.logprobs) for s in o.samples] for o in want])
