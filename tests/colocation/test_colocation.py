"""Colocation: sleep / wake / update_weights cycles, memory given back, ColocatedRollout.

The reference for "correct" is always a fresh engine built from the same weights: a cycled
engine must produce the very same tokens and logprobs, bit for bit (same dtype, same kernels).
"""

import copy
import dataclasses
import gc
import weakref

import pytest
import torch
from models import tiny_model
from reference import assert_matches_reference
from torch import nn

from rollout import Engine, EngineConfig, SamplingParams
from rollout.colocation.device_memory import tensor_bytes
from rollout.spec import SpeculativeConfig
from trainer_hooks import ColocatedRollout

CONFIG = EngineConfig(kv_cache_tokens=512, max_model_len=96, max_num_seqs=16)
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [1, 2, 3, 4, 5, 6, 10, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=True)
SEEDED = SamplingParams(n=3, temperature=0.9, top_p=0.95, max_tokens=10, logprobs=True, seed=7)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls on a shared 2-core box: thread hand-off costs more than it saves (30x here).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(engine):
    """(tokens, logprobs) of a greedy and a seeded-sampling batch."""
    outs = engine.generate(PROMPTS, GREEDY) + engine.generate(PROMPTS, SEEDED)
    return [[(s.token_ids, s.logprobs) for s in o.samples] for o in outs]


def fresh(model):
    return run(Engine(model, CONFIG))


def weight_bytes(engine):
    return tensor_bytes(engine.model.parameters())


@pytest.mark.parametrize("level", [0, 1, 2])
def test_cycles_match_a_fresh_engine(level):
    """Level 0: update while awake, so the prefix cache still holds the old weights' KV of
    these very prompts; update_weights must drop it or the outputs differ."""
    a, b = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    want_a, want_b = fresh(a), fresh(b)
    assert want_a != want_b
    engine = Engine(a, CONFIG)
    for source, want in [(b, want_b), (a, want_a), (b, want_b)]:
        run(engine)  # fills the prefix cache
        if level:
            engine.sleep(level)
            engine.wake_up()
        engine.update_weights(source)
        assert run(engine) == want
        engine.check_invariants()


def test_optimizer_step_changes_outputs_and_matches_fresh_engine():
    model = tiny_model("llama")
    engine = Engine(model, CONFIG)
    before = run(engine)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    ids = torch.tensor([PROMPTS[0] + [20, 21, 22, 23]])
    model.train()
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    engine.sleep(1)
    engine.wake_up()
    engine.update_weights(model)
    after = run(engine)
    assert after != before
    assert after == fresh(model)


@pytest.mark.parametrize("level", [1, 2])
def test_requests_while_asleep_raise(level):
    engine = Engine(tiny_model("qwen2"), CONFIG)
    engine.sleep(level)
    assert engine.is_sleeping
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, GREEDY)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.update_weights(tiny_model("qwen2"))
    assert not engine.has_unfinished


def test_sleep2_refuses_to_generate_until_every_weight_is_back():
    model = tiny_model("qwen2")
    engine = Engine(model, CONFIG)
    engine.sleep(2)
    engine.wake_up()
    assert engine.needs_weights
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPTS, GREEDY)
    with pytest.raises(ValueError, match="missing"):  # one tensor is not enough
        engine.update_weights({"model.norm.weight": model.model.norm.weight})
    assert engine.needs_weights
    engine.update_weights(model)
    assert not engine.needs_weights
    assert run(engine) == fresh(model)


def test_error_inside_colocated_rollout_leaves_engine_asleep_and_usable():
    model = tiny_model("qwen2")
    engine = Engine(model, CONFIG)
    rollout = ColocatedRollout(engine, model, sleep_level=2)
    with pytest.raises(KeyError):
        with rollout as r:
            r.engine.add_request(PROMPTS[0], GREEDY)
            r.engine.step()
            raise KeyError("reward function failed")
    assert engine.is_sleeping and not engine.has_unfinished
    assert engine.memory_held() == 0
    with rollout as r:
        got = run(r.engine)
    assert got == fresh(model)
    assert engine.is_sleeping


def test_error_while_syncing_still_sleeps():
    model = tiny_model("qwen2")
    engine = Engine(model, CONFIG)
    engine.sleep(1)
    other = tiny_model("qwen2", vocab_size=100)  # embeddings of the wrong shape
    with pytest.raises((ValueError, RuntimeError)):
        with ColocatedRollout(engine, other, synced=False):
            pass
    assert engine.is_sleeping


def test_memory_held_after_sleep():
    model = tiny_model("qwen2")
    engine = Engine(model, CONFIG)
    engine.generate(PROMPTS, GREEDY)
    awake = engine.memory_held()
    weights = weight_bytes(engine)
    assert awake > weights + engine.inspect().kv_bytes - 1 > weights  # pool and table are counted
    engine.sleep(2)
    assert engine.memory_held() == 0
    engine.wake_up()
    engine.update_weights(model)
    assert engine.memory_held() == awake
    engine.sleep(1)
    # On CPU, level 1 leaves the weights where they are; everything else is gone.
    assert engine.inspect().kv_bytes == 0 and engine.pool.buffer is None
    assert engine.memory_held() == weights


def _tensor_storages() -> dict[int, torch.Tensor]:
    """Every live CPU tensor with storage, one per storage address."""
    gc.collect()
    # type(), not isinstance(): isinstance reads __class__, which trips deprecated-module proxies.
    return {o.untyped_storage().data_ptr(): o for o in gc.get_objects()
            if issubclass(type(o), torch.Tensor) and o.device.type == "cpu" and o.numel()}


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_memory_held_of_a_model_free_drafter_is_the_targets(method):
    """A drafter without a model holds no device memory (it had no stack to count: every
    memory_held() of such an engine raised AttributeError)."""
    model = tiny_model("qwen2")
    spec = SpeculativeConfig(method, num_speculative_tokens=3)
    engine = Engine(model, dataclasses.replace(CONFIG, speculative=spec))
    plain = Engine(model, CONFIG)
    for level in (0, 1, 2):
        if level:
            engine.sleep(level)
            plain.sleep(level)
        assert engine.memory_held() == plain.memory_held()


def test_memory_held_counts_the_draft_models_stack():
    model = tiny_model("qwen2")
    draft = tiny_model("qwen2", seed=3, num_hidden_layers=1)
    before = _tensor_storages()  # held: no address of theirs is reused by the engine's tensors
    spec = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=draft)
    engine = Engine(model, dataclasses.replace(CONFIG, speculative=spec))
    engine.generate(PROMPTS, GREEDY)

    def measured() -> int:
        return sum(t.untyped_storage().nbytes() for ptr, t in _tensor_storages().items()
                   if ptr not in before)

    draft_weights = tensor_bytes(engine.speculator.drafter.stack.model.parameters())
    for level in (0, 1, 2):
        if level:
            engine.sleep(level)
        # Left out: the prefix cache's slot lists (8 bytes a cached token) and rotary inv_freq.
        assert abs(measured() - engine.memory_held()) <= 1024, level
    # The draft's weights are parked, not dropped, at level 2 (on the CPU: in place).
    assert engine.memory_held() == draft_weights > 0


def _live_tensors() -> int:
    gc.collect()
    # type(), not isinstance(): isinstance reads __class__, which trips deprecated-module proxies.
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def test_hundred_cycles_do_not_grow():
    model = tiny_model("qwen2")
    engine = Engine(model, CONFIG)
    rollout = ColocatedRollout(engine, model, sleep_level=1)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=1)
    marks = {}
    for i in range(100):
        with rollout as r:
            r.sync_weights(force=True)  # exercise update_weights every cycle
            r.generate(PROMPTS[:2], params)
            held = engine.memory_held()
        engine.sleep(2)  # alternate the levels: deepen to 2, then a plain level-1 exit next time
        assert engine.memory_held() == 0
        if i in (9, 99):
            marks[i] = (held, _live_tensors())
    assert marks[9][0] == marks[99][0]
    assert abs(marks[99][1] - marks[9][1]) <= 5, marks


def test_colocated_rollout_syncs_only_when_weights_changed(monkeypatch):
    model = tiny_model("qwen2")
    engine = Engine(model, CONFIG)
    calls = []
    real = engine.update_weights
    monkeypatch.setattr(engine, "update_weights", lambda src, **kw: calls.append(1) or real(src))
    rollout = ColocatedRollout(engine, model, sleep_level=1)
    for _ in range(3):
        with rollout as r:
            r.generate(PROMPTS[:1], GREEDY)
    assert calls == []
    # Fused kernels (the HF Trainer's default AdamW) do not bump autograd version counters.
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    rollout.watch(opt)
    model.model.norm.weight.grad = torch.ones_like(model.model.norm.weight)
    opt.step()
    with rollout as r:
        got = run(r.engine)
    assert len(calls) == 1 and got == fresh(model)
    with rollout:
        pass
    assert len(calls) == 1
    # Level 2 drops the weights on exit: every later entry must refill them, changed or not.
    rollout2 = ColocatedRollout(engine, model, sleep_level=2)
    for _ in range(3):
        with rollout2:
            pass
    assert len(calls) == 3


@pytest.mark.parametrize("given", ["another model", "a state dict"])
def test_synced_is_trusted_only_for_the_model_the_weights_came_from(given):
    """synced=True (the default) for a model the engine's weights did not come from (built
    from another, or last updated from a state dict) syncs at the first entry: the block
    samples from the model it was given, never silently from other weights."""
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    engine = Engine(a if given == "another model" else b, CONFIG)
    if given == "a state dict":
        engine.update_weights(dict(b.state_dict()))
    assert engine.holds_weights_of(DDPLike(a)) == (given == "another model")
    assert not engine.holds_weights_of(b)
    rollout = ColocatedRollout(engine, b)
    with rollout as r:
        assert rollout.synced
        got = run(r.engine)
    assert got == fresh(b) and engine.holds_weights_of(DDPLike(b))
    with ColocatedRollout(engine, DDPLike(b)) as r:  # now trusted, wrapper peeled
        assert not r.synced


class DDPLike(nn.Module):
    """What DistributedDataParallel looks like to a weight reader: the model under `.module`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_ddp_like_wrapper_updates_engine():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    engine = Engine(a, CONFIG)
    wrapped = DDPLike(b)
    assert next(iter(wrapped.state_dict())).startswith("module.")
    with ColocatedRollout(engine, wrapped, synced=False) as r:
        got = run(r.engine)
    assert got == fresh(b)


def test_peft_lora_merged_mode_folds_the_adapter_and_leaves_the_trainer_unmerged():
    """EngineConfig(lora="merged"): the adapter is folded into the engine's weights (out of
    place: the trainer's model is left as it was). The default serves it unmerged
    (tests/lora/)."""
    peft = pytest.importorskip("peft")
    base = tiny_model("llama", seed=0)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # zero-initialised B would make the merge a no-op
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = copy.deepcopy(model).merge_and_unload()
    assert fresh(merged) != fresh(base)

    engine = Engine(base, dataclasses.replace(CONFIG, lora="merged"))
    rollout = ColocatedRollout(engine, model, synced=False)
    with rollout as r:
        got = run(r.engine)
    assert got == fresh(merged)
    assert engine.lora_status is None
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed: the adapter was left merged"
    assert not any(getattr(m, "merged", False) for m in model.modules())
    with rollout:  # the merge/unmerge of the read is not a change to sync again
        assert not rollout.sync_weights()


def test_custom_loop_logprobs_equal_trainer_recompute():
    """The engine's logprobs are what the trainer recomputes (log_softmax(logits / T) at the
    sampled token, unfiltered by top-p), so the first-iteration importance ratio is 1 —
    before and after a training step."""
    model = tiny_model("qwen2")
    engine = Engine(model, CONFIG)
    rollout = ColocatedRollout(engine, model, sleep_level=1)
    params = SamplingParams(n=4, temperature=0.7, top_p=0.9, max_tokens=12, logprobs=True, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(2):
        with rollout as r:
            outs = r.generate(PROMPTS, params)
        assert engine.is_sleeping
        # the weights the trainer holds now, within the float64 floor (tests/support/floors.py)
        assert_matches_reference(model, PROMPTS, outs, greedy=False, temperature=0.7)
        loss = 0.0
        for prompt, out in zip(PROMPTS, outs):
            for s in out.samples:
                ids = torch.tensor([prompt + s.token_ids])
                logits = model(ids).logits[0, len(prompt) - 1:-1] / 0.7
                lp = logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0]
                loss = loss - lp.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_sleep_frees_the_prefix_tree_without_waiting_for_the_garbage_collector():
    engine = Engine(tiny_model("qwen2"), EngineConfig(kv_cache_tokens=1024, max_model_len=64))
    engine.generate([[1, 2, 3], [4, 5, 6], [1, 2, 3, 9]],
                    SamplingParams(n=3, max_tokens=8, seed=0))
    slots = [weakref.ref(node.value) for node in engine.cache.nodes()]
    assert slots
    gc.disable()
    try:
        engine.sleep(1)
        assert all(ref() is None for ref in slots)  # freed by refcount, as device memory must be
    finally:
        gc.enable()


def test_nested_blocks_keep_the_engine_awake_until_the_outermost_exits():
    """An evaluation helper opening its own block inside the step's (same wrapper, or another
    wrapper sharing the engine) must not abort the outer block's requests or put the engine to
    sleep under it."""
    model = tiny_model("qwen2")
    engine = Engine(model, CONFIG)
    rollout, scorer = ColocatedRollout(engine, model), ColocatedRollout(engine, model)
    with rollout as r:
        rid = r.engine.add_request(PROMPTS[0], GREEDY)
        for inner in (rollout, scorer):
            with inner:
                inner.generate(PROMPTS[1:], GREEDY)
            assert not engine.is_sleeping and engine.has_unfinished
        got = run(r.engine)  # still awake; the streaming request is still there
        while engine.has_unfinished:
            engine.step()
    # Tokens only: the streaming request shares those batches, which moves logprobs by ~1 ulp.
    assert [[t for t, _ in o] for o in got] == [[t for t, _ in o] for o in fresh(model)]
    assert rid is not None and engine.is_sleeping and engine.inspect().kv_bytes == 0
    # An error in an inner block still sleeps the engine when the outer block exits.
    with pytest.raises(KeyError), rollout, scorer:
        raise KeyError("reward function failed")
    assert engine.is_sleeping and not engine.has_unfinished
    with scorer:  # and the next block works
        assert run(scorer.engine) == fresh(model)
    assert engine.is_sleeping


@pytest.mark.parametrize("carry", [False, True], ids=["plain", "carry"])
def test_leaving_ends_the_blocks_streaming_requests_complete_or_not(carry):
    """Leaving ends the block's streaming requests (add_request), running or complete with an
    output step() has not returned, with carry=True as without: carry keeps rollout()'s groups
    only. A complete one had outlived a carry=True block (a running one did not): a later
    block's step() handed it out, a step late, and its id was still taken."""
    model = tiny_model("qwen2")
    engine = Engine(model, CONFIG)
    short = SamplingParams(temperature=0, max_tokens=2)
    with ColocatedRollout(engine, model, carry=carry) as r:
        r.engine.add_request(PROMPTS[1], short, request_id="eval", hold_kv=True)
        r.engine.add_request(PROMPTS[1], dataclasses.replace(short, max_tokens=80))
        group = r.rollout(PROMPTS[:1], GREEDY, groups=0, request_ids=["group"])
        r.generate(PROMPTS[2:], GREEDY)  # "eval" completes meanwhile, uncollected
        assert group == [] and engine.has_unfinished
    assert engine.carried == (["group"] if carry else [])
    assert not engine.has_unfinished and set(engine.running_requests) <= {"group"}
    assert engine.inspect().holds == ()
    with ColocatedRollout(engine, model, carry=carry) as r:
        r.engine.add_request(PROMPTS[1], short, request_id="eval")  # the id is free again
        outs = []
        while engine.has_unfinished:
            outs += engine.step()
        assert [o.request_id for o in outs] == ["eval"]
        assert [o.request_id for o in r.rollout()] == (["group"] if carry else [])
    engine.check_invariants()


def test_a_block_for_another_model_inside_an_open_one_is_refused():
    """Nested blocks on one engine share its weights: a block for another model inside an open
    one had synced that model in, and the outer block's later calls sampled from it (its
    tokens were the other model's). Refused at entry, changing nothing; the same model through
    another wrapper (DDP) still nests, and blocks of two engines nest, each waking and putting
    to sleep its own."""
    a, b = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    want_a, want_b = fresh(a), fresh(b)
    engine, other = Engine(a, CONFIG), Engine(b, CONFIG)
    other.sleep(1)
    outer, inner = ColocatedRollout(engine, a), ColocatedRollout(engine, b, synced=False)
    with outer:
        version = engine.weights_version
        with pytest.raises(RuntimeError, match="another model"), inner:
            pass
        with ColocatedRollout(engine, DDPLike(a)):
            pass
        assert engine.weights_version == version and not engine.is_sleeping
        with ColocatedRollout(other, b) as r:
            assert run(r.engine) == want_b
        assert other.is_sleeping and not engine.is_sleeping
        assert run(engine) == want_a
    assert engine.is_sleeping
    with inner:  # on its own, the other model's block syncs it in
        assert run(engine) == want_b
    assert engine.is_sleeping
