"""Routes of samples carried across update_weights (Engine.rollout): Sample.routed_versions says
which weights computed each row of Sample.routed_experts, and each row holds what transformers'
own routers choose under those weights, attending to what the engine's forward attended to.

The reference runs the old weights' model A over the rows of version 0 and the new weights'
model B over the rest, B's forward continuing from A's K/V cache (carried_kv="park": the sample
goes on from the old weights' K/V) or from nothing (carried_kv="recompute": everything is
recomputed under B; its Sample.earlier_routes then hold the rows as A computed them). The
routers of B are perturbed far from A's, so the two references route most rows apart and a row
of the wrong weights cannot pass. Prefix caching is on (the default): siblings share their
prompt's K/V, and the update keeps the old routes from the cache.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import pytest
import torch
from models import tiny_model
from test_faults import Fault
from test_moe_routing import reference_routes

import rollout.requests.outputs as outputs
from rollout import Engine, EngineConfig, SamplingParams
from rollout_recipes.algo.routing_replay import routed_expert_batch, routing_replay

PROMPTS = [[1, 2, 3], list(range(10, 40)), [5, 99, 3, 100, 6, 7]]
# Each call hands out the first group only; the others are carried mid-way (they need more
# tokens), two samples each so that siblings share their prompt's K/V through the cache.
PARAMS = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=3 + 12 * i,
                         return_routed_experts=True) for i in range(3)]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def old_and_new(request):
    """(A, B): a tiny MoE model and a copy whose routers moved by a unit normal each weight."""
    if request.param == "qwen3_moe":
        old = tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0])
    else:
        old = tiny_model("mixtral")
    new = copy.deepcopy(old)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=generator))
    return old, new


def reference(old, new, text: list[int], first_new: int, parked: bool):
    """Routes of `text`: rows before `first_new` under `old`, the rest under `new`, which
    attends to `old`'s K/V of those rows when `parked` (else `new` recomputes them: first_new
    is then 0)."""
    if first_new == 0:
        ids, tie, _ = reference_routes(new, text)
        return ids, tie
    assert parked
    ids_a, tie_a, cache = reference_routes(old, text[:first_new])
    ids_b, tie_b, _ = reference_routes(new, text[first_new:], cache)
    return torch.cat([ids_a, ids_b]), torch.cat([tie_a, tie_b])


def carried_outputs(model, new, mode: str):
    """The groups carried across the update (each handed out once complete), and a fresh
    request for a carried prompt afterwards (its prompt's K/V must be the new weights')."""
    engine = Engine(copy.deepcopy(model), EngineConfig(kv_cache_tokens=1024, max_model_len=96,
                                                      carried_kv=mode))
    assert len(engine.rollout(PROMPTS, PARAMS, groups=1)) == 1
    engine.update_weights(new)
    carried = engine.rollout(groups=None)
    fresh = engine.generate([PROMPTS[2]], [PARAMS[2]])
    engine.check_invariants()
    return carried, fresh[0]


def expected_versions(sample, prompt_len: int, mode: str) -> torch.Tensor:
    """Independent of the pool: under park each output row was computed by the forward that
    sampled the next token (weights_versions), the prompt's before the first token; under
    recompute the update re-prefilled every row under the new weights."""
    wv = sample.weights_versions
    if mode == "recompute":
        return torch.full((prompt_len + len(wv) - 1,), wv[-1], dtype=torch.int32)
    # Row P - 1 + j is the input of the forward that sampled token j.
    return torch.tensor([wv[0]] * (prompt_len - 1) + wv, dtype=torch.int32)


def assert_earlier_routes(sample, prompt: list[int], models: list) -> None:
    """carried_kv="recompute": before the i-th update the sample crossed, its K/V held one row
    per token so far but the newest, all computed under weights version i (`models[i]`; the
    pool is roomy, nothing was evicted) and routed as transformers' routers route them: the
    routes its tokens of version i were sampled under."""
    assert len(sample.earlier_routes) == len(models)
    text = prompt + sample.token_ids
    for version, (model, (routes, versions)) in enumerate(zip(models, sample.earlier_routes)):
        rows = len(prompt) + sum(v <= version for v in sample.weights_versions) - 1
        assert routes.dtype == torch.int16 and routes.shape[0] == rows
        assert torch.equal(versions, torch.full((rows,), version, dtype=torch.int32))
        ref, tie, _ = reference_routes(model, text[:rows])
        differs = (routes.long() != ref).any(-1)
        assert not (differs & ~tie).any(), f"{int(differs.sum())} earlier rows route apart"


@pytest.mark.parametrize("mode", ["recompute", "park"])
def test_carried_routes_are_those_of_the_weights_their_versions_name(old_and_new, mode):
    old, new = old_and_new
    carried, fresh = carried_outputs(old, new, mode)
    assert len(carried) == 2
    rows = old_rows = apart = 0
    for out in [*carried, fresh]:
        prompt = out.prompt_token_ids
        for sample in out.samples:
            routes, versions = sample.routed_experts, sample.routed_versions
            text = prompt + sample.token_ids[:-1]
            assert versions.dtype == torch.int32 and versions.shape == (len(text),)
            assert routes.shape[0] == len(text)
            if out is fresh:
                assert (versions == 1).all() and set(sample.weights_versions) == {1}
            else:
                assert sample.weights_versions[0] == 0 and sample.weights_versions[-1] == 1
                assert torch.equal(versions, expected_versions(sample, len(prompt), mode))
            first_new = int((versions == 0).sum())
            old_rows += first_new
            if mode == "park" or out is fresh:
                assert sample.earlier_routes == []
            else:
                assert_earlier_routes(sample, prompt, [old])
            assert (versions[:first_new] == 0).all() and (versions[first_new:] == 1).all()
            ref, tie = reference(old, new, text, first_new, parked=mode == "park")
            differs = (routes.long() != ref).any(-1)
            assert not (differs & ~tie).any(), f"{int(differs.sum())} rows route apart"
            # A test that tells the weights apart: on the rows each mode's trainer could
            # mistake (park: the old weights' rows; recompute: every row, those of tokens
            # sampled under the old weights included), the other weights route otherwise.
            if out is not fresh:
                mistaken = first_new if mode == "park" else len(text)
                other, _, _ = reference_routes(new if mode == "park" else old, text[:mistaken])
                rows += mistaken
                apart += int((other != ref[:mistaken]).any(-1).any(-1).sum())
    assert (old_rows > 0) == (mode == "park")
    assert apart > rows // 2, (apart, rows)


# --- faults at the new points -----------------------------------------------------------------
# point -> where it is, given the engine: the commit stamping the step's slots with their
# version, a finished sample reading its routes and their versions, the output taking them.
FAULT_POINTS = {
    "stamp": lambda e: (e.kv.pool, "stamp_version"),
    "read": lambda e: (e.committer, "_read_routed_experts"),
    "output": lambda e: (outputs, "_routes"),
}


def view(outs):
    return sorted((tuple(o.prompt_token_ids), s.index, tuple(s.token_ids),
                   tuple(s.weights_versions), s.routed_experts.tolist(),
                   s.routed_versions.tolist(),
                   [(routes.tolist(), versions.tolist()) for routes, versions in s.earlier_routes])
                  for o in outs for s in o.samples)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("point", list(FAULT_POINTS))
@pytest.mark.parametrize("mode", ["recompute", "park"])
def test_fault_at_a_routes_point_leaves_the_engine_exact(old_and_new, mode, point, after, kind,
                                                         monkeypatch):
    """A fault at the 2nd call of each new point while the carried groups finish after the
    update: the call raises, the invariants hold, and the next call hands out what the
    uninterrupted run does, routes and their versions included."""
    old, new = old_and_new
    want, _ = carried_outputs(old, new, mode)
    engine = Engine(copy.deepcopy(old), EngineConfig(kv_cache_tokens=1024, max_model_len=96,
                                                    carried_kv=mode))
    engine.rollout(PROMPTS, PARAMS, groups=1)
    engine.update_weights(new)
    fault = Fault(kind, at=2, after=after)
    fault.install(monkeypatch, *FAULT_POINTS[point](engine))
    with pytest.raises(kind, match="injected"):
        engine.rollout(groups=None)
    assert fault.fired
    monkeypatch.undo()
    engine.check_invariants()
    assert view(engine.rollout(groups=None)) == view(want)
    engine.check_invariants()


# point -> where it is: keeping the carried samples' routes at the update, and the cache clear
# after it (in one unit with it: a clear that fails must not leave routes kept twice).
UPDATE_POINTS = {
    "keep": lambda e: (e.carry, "keep_routes"),
    "clear": lambda e: (e.kv, "clear_cache"),
}


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("point", list(UPDATE_POINTS))
def test_fault_while_an_update_keeps_routes_leaves_the_engine_exact(old_and_new, point, after,
                                                                    kind, monkeypatch):
    """A fault as update_weights keeps the carried samples' routes, or clears the cache after:
    the update raises and is refused until a complete one; after that the carried groups come
    out as the uninterrupted run's, each sample's earlier routes kept once."""
    old, new = old_and_new
    want, _ = carried_outputs(old, new, "recompute")
    engine = Engine(copy.deepcopy(old), EngineConfig(kv_cache_tokens=1024, max_model_len=96))
    engine.rollout(PROMPTS, PARAMS, groups=1)
    fault = Fault(kind, at=1, after=after)
    fault.install(monkeypatch, *UPDATE_POINTS[point](engine))
    with pytest.raises(kind, match="injected"):
        engine.update_weights(new)
    assert fault.fired
    monkeypatch.undo()
    engine.check_invariants()
    assert all(s.earlier_routes == () for s in engine.scheduler.waiting)
    engine.update_weights(new)
    assert view(engine.rollout(groups=None)) == view(want)
    engine.check_invariants()


def test_a_sample_carried_across_two_updates_keeps_the_routes_of_each(old_and_new):
    """Two updates (A to B, B back to A) while the longest group runs: its samples keep the
    routes of versions 0 and 1, and return version 2's."""
    old, new = old_and_new
    engine = Engine(copy.deepcopy(old), EngineConfig(kv_cache_tokens=1024, max_model_len=96))
    engine.rollout(PROMPTS, PARAMS, groups=1)
    engine.update_weights(new)
    engine.rollout(groups=1)
    engine.update_weights(old)
    (out,) = engine.rollout(groups=None)
    for sample in out.samples:
        assert sorted(set(sample.weights_versions)) == [0, 1, 2]
        assert_earlier_routes(sample, out.prompt_token_ids, [old, new])
        assert (sample.routed_versions == 2).all()
        ref, tie, _ = reference_routes(old, out.prompt_token_ids + sample.token_ids[:-1])
        assert not ((sample.routed_experts.long() != ref).any(-1) & ~tie).any()


def test_routes_come_to_the_host_in_one_copy_per_read(old_and_new, monkeypatch):
    """Each device-to-host copy waits for the device: a finished sample's routes and their
    versions come in one copy, and an update keeps the routes of every carried sample in one
    (it took two per sample for both). Counted: Tensor.cpu called from the files that read
    routes (the engine copies other things, weights and sampling's results, elsewhere)."""
    old, new = old_and_new
    engine = Engine(copy.deepcopy(old), EngineConfig(kv_cache_tokens=1024, max_model_len=96))
    engine.rollout(PROMPTS, PARAMS, groups=1)
    copies = []
    to_host = torch.Tensor.cpu
    readers = ("engine/commit.py", "engine/carry.py", "kv/pool.py")

    def counted(tensor, *args, **kwargs):
        if sys._getframe(1).f_code.co_filename.endswith(readers):
            copies.append(tensor)
        return to_host(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    engine.update_weights(new)
    carried = [s for s in engine.scheduler.waiting if s.earlier_routes]
    assert len(carried) >= 2 and len(copies) == 1
    copies.clear()
    outs = engine.rollout(groups=None)
    finished_now = [s for o in outs for s in o.samples if s.weights_versions[-1] == 1]
    assert finished_now and len(copies) == len(finished_now)
    monkeypatch.undo()
    for out in outs:
        for sample in out.samples:
            assert_earlier_routes(sample, out.prompt_token_ids, [old])


@pytest.mark.parametrize("mode", ["recompute", "park"])
def test_replay_forces_only_the_rows_of_the_trainers_weights(old_and_new, mode):
    """The custom loop's replay (rollout_recipes.algo.routing_replay) routes as the trainer's
    weights at the step's start route (B, version 1 here): their proximal policy. Rows of
    another version (park: those A computed before the update) are -1 in the batch, and the
    trainer's routers route them as transformers' B does; the other rows are forced to the
    engine's. Under recompute every row is B's and forced."""
    old, new = old_and_new
    carried, _ = carried_outputs(old, new, mode)
    trainer = copy.deepcopy(new)
    used = []  # each MoE block's top-k ids handed to its experts
    hooks = [m.register_forward_pre_hook(lambda m, args: used.append(args[1]))
             for name, m in trainer.named_modules() if name.endswith("mlp.experts")]
    stale_rows = apart = 0
    try:
        for out in carried:
            for sample in out.samples:
                text = out.prompt_token_ids + sample.token_ids
                routes = routed_expert_batch([SimpleNamespace(samples=[sample])], len(text),
                                             trainer, 1)
                used.clear()
                with torch.no_grad(), routing_replay(trainer, routes):
                    trainer(torch.tensor([text]), use_cache=False)
                used_ids = torch.stack(used, 1).view(routes.shape)[0]
                rows, stale = len(sample.routed_experts), sample.routed_versions != 1
                first_new = int(stale.sum())  # versions only grow: the stale rows lead
                assert (routes[0, :first_new] == -1).all()
                assert torch.equal(used_ids[first_new:rows], sample.routed_experts[~stale].long())
                stale_rows += first_new
                if first_new:
                    ref, tie, _ = reference_routes(new, text[:first_new])
                    own = used_ids[:first_new].sort(-1).values
                    assert not ((own != ref.sort(-1).values).any(-1) & ~tie).any()
                    apart += int((sample.routed_experts[stale].long() != ref).any(-1).any(-1)
                                 .sum())
    finally:
        for hook in hooks:
            hook.remove()
    assert (stale_rows > 0) == (mode == "park")
    assert apart >= stale_rows / 2  # A's rows would have told: B routes most of them apart
