"""Edges of weight sync and sleep: a failed update changes nothing (a model of another
architecture, junk bucket_bytes), sleep(1) -> sleep(2) deepens without touching the device, a
sleep failing after the memory went leaves the engine asleep, a failed wake-up hands back the
memory it took, rollout.generate takes a
checkpoint path, `.data` reassignment counts as a weight change, a second one landing on the
first one's freed address too, and ColocatedRollout syncs again after another wrote the
engine."""

import pytest
import torch
from models import char_tokenizer, tiny_model
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import rollout
import rollout.colocation.colocation as colocation
from rollout import Engine, EngineConfig, SamplingParams
from rollout.api import engine_for
from rollout.colocation.device_memory import tensor_bytes
from rollout.colocation.weights import weights_version
from rollout.kv.pool import KVPool
from rollout.spec import SpeculativeConfig
from trainer_hooks import ColocatedRollout

CONFIG = dict(kv_cache_tokens=512, max_model_len=64)
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=True)


def tokens(outs):
    return [[(s.token_ids, s.logprobs) for s in o.samples] for o in outs]


def token_ids(samples):
    return [[ids for ids, _ in o] for o in samples]


def fresh(model):
    return tokens(Engine(model, EngineConfig(**CONFIG)).generate(PROMPTS, GREEDY))


# --- a failed update_weights changes nothing -------------------------------------------------
def _bad_name(named):
    named.insert(len(named) - 1, ("model.layers.0.mlp.bogus.weight", torch.zeros(1)))
    return "model.layers.0.mlp.bogus.weight"


def _bad_shape(named):
    named[-1] = ("model.norm.weight", torch.ones(3))
    return r"model\.norm\.weight.*\(3,\).*expected \(64,\)"


@pytest.mark.parametrize("spoil", [_bad_name, _bad_shape])
def test_failed_update_changes_neither_weights_nor_cache(spoil):
    old, new = tiny_model("llama", seed=0), tiny_model("llama", seed=7)
    engine = Engine(old, EngineConfig(**CONFIG))
    engine.generate(PROMPTS, GREEDY)  # the prefix cache now holds the old weights' K/V
    before = {n: p.clone() for n, p in engine.model.named_parameters()}
    cached = engine.inspect().cached_tokens
    named = list(new.named_parameters())
    match = spoil(named)  # the bad tensor comes last but one: most good ones precede it
    with pytest.raises(ValueError, match=match):
        engine.update_weights((n, p.detach()) for n, p in named)  # a generator
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    assert engine.inspect().cached_tokens == cached > 0
    # Prefill from the cache rounds differently from a fresh prefill: compare the tokens only.
    assert token_ids(tokens(engine.generate(PROMPTS, GREEDY))) == token_ids(fresh(old))
    engine.update_weights((n, p.detach()) for n, p in new.named_parameters())
    assert tokens(engine.generate(PROMPTS, GREEDY)) == fresh(new)


def test_failed_update_after_sleep2_still_needs_every_weight():
    model = tiny_model("llama")
    engine = Engine(model, EngineConfig(**CONFIG))
    engine.sleep(2)
    engine.wake_up()
    with pytest.raises(ValueError, match="bogus"):
        engine.update_weights({**dict(model.named_parameters()), "bogus.weight": torch.ones(1)})
    assert engine.needs_weights
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPTS, GREEDY)


# --- sleep(1) -> sleep(2) deepens in place ---------------------------------------------------
def test_deepening_sleep_allocates_nothing_and_then_needs_weights(monkeypatch):
    model = tiny_model("llama")
    draft = tiny_model("llama", seed=3, num_hidden_layers=1)
    spec = SpeculativeConfig("draft", num_speculative_tokens=2, draft_model=draft)
    engine = Engine(model, EngineConfig(**CONFIG, speculative=spec))
    want = tokens(engine.generate(PROMPTS, GREEDY))
    engine.sleep(1)
    allocations = []
    real = KVPool.allocate
    monkeypatch.setattr(KVPool, "allocate", lambda pool: allocations.append(pool) or real(pool))
    engine.sleep(2)
    assert allocations == []  # neither the target's pool nor the draft's
    assert engine.sleep_level == 2 and engine.needs_weights
    # On CPU level 1 kept the target's weights in place; now dropped. The draft's are parked
    # (in place on the CPU) whatever the level.
    draft_weights = tensor_bytes(engine.speculator.drafter.stack.model.parameters())
    assert engine.memory_held() == draft_weights > 0
    assert engine.stack.parking.host_bytes == 0
    engine.wake_up()
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPTS, GREEDY)
    engine.update_weights(model)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == want
    engine.check_invariants()


def test_parked_host_weights_are_dropped_when_deepening():
    """On a GPU level 1 parks the weights on the host; deepening must drop that copy, not bring
    it back. On CPU the seam (separate_host, see rollout/colocation/parking.py) parks them as a GPU does."""
    from rollout.colocation.device_memory import tensor_bytes
    from rollout.colocation.parking import WeightParking

    model = tiny_model("llama")
    shapes = {n: p.shape for n, p in model.named_parameters()}
    weights = tensor_bytes(model.parameters())
    parking = WeightParking(model, torch.device("cpu"), separate_host=True)
    parking.park(1)
    assert parking.host_bytes == weights and tensor_bytes(model.parameters()) == 0
    parking.park(2)
    assert parking.host_bytes == 0 and parking.dropped_any
    assert {n: s for n, (s, _) in parking.dropped.items()} == shapes
    parking.restore()
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    assert not parking.dropped_any


# --- rollout.generate with a checkpoint path -------------------------------------------------
def test_generate_accepts_a_checkpoint_path(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    cfg = dict(CONFIG, device="cpu")
    want = fresh(model)
    assert tokens(rollout.generate(str(tmp_path), PROMPTS, GREEDY, **cfg)) == want
    engine = engine_for(str(tmp_path), **cfg)
    assert engine_for(tmp_path / ".", **cfg) is engine  # one engine per resolved path
    engine.sleep(2)  # the next call reads the checkpoint again
    assert tokens(rollout.generate(str(tmp_path), PROMPTS, GREEDY, **cfg)) == want
    assert engine_for(str(tmp_path), **dict(cfg, max_model_len=32)) is not engine


# --- `.data` reassignment is a weight change ------------------------------------------------
def _assign_data(model):
    for p in model.parameters():
        p.data = p.data * -1


def _vector_to_parameters(model):
    vector_to_parameters(parameters_to_vector(model.parameters()) * -1, model.parameters())


REASSIGNMENTS = [_assign_data, _vector_to_parameters]


@pytest.mark.parametrize("reassign", REASSIGNMENTS)
def test_generate_follows_data_reassignment(reassign):
    model = tiny_model("llama")
    before = tokens(rollout.generate(model, PROMPTS, GREEDY, **CONFIG))
    version = weights_version(model)
    reassign(model)
    assert weights_version(model) != version
    after = tokens(rollout.generate(model, PROMPTS, GREEDY, **CONFIG))
    assert after == fresh(model) != before


@pytest.mark.parametrize("reassign", REASSIGNMENTS)
def test_colocated_rollout_follows_data_reassignment(reassign):
    model = tiny_model("llama")
    engine = Engine(model, EngineConfig(**CONFIG))
    hook = ColocatedRollout(engine, model)
    with hook as r:
        before = tokens(r.generate(PROMPTS, GREEDY))
    assert not hook.synced
    reassign(model)
    with hook as r:
        after = tokens(r.generate(PROMPTS, GREEDY))
    assert hook.synced
    assert after == fresh(model) != before


# --- two swaps between syncs, the second at the first one's freed address ----------------------
def _swap_twice_onto_old_address(param) -> bool:
    """`param.data = -param`, then a second tensor (the same weights times -2) allocated while
    the first swap's still lives, at the address of the storage before both (the allocator
    hands it out again): the data pointer and the version counter are as before, the weights
    are not. False where no allocation within 64 landed there."""
    address = param.data_ptr()
    param.data = param.data * -1
    held = []  # the misses stay allocated, so the next try gets another block
    for _ in range(64):
        t = torch.empty_like(param.data)
        if t.data_ptr() == address:
            param.data = t.copy_(param.data * 2)
            return True
        held.append(t)
    return False


def test_weights_version_sees_a_swap_onto_a_freed_address():
    linear = torch.nn.Linear(64, 64, bias=False)
    for _ in range(20):
        version = weights_version(linear)
        if _swap_twice_onto_old_address(linear.weight):
            break
    else:
        pytest.skip("this allocator never handed the freed address out again")
    assert weights_version(linear) != version


def test_generate_follows_two_swaps_onto_a_freed_address():
    model = tiny_model("llama")
    head = model.get_output_embeddings().weight
    for _ in range(20):
        before = tokens(rollout.generate(model, PROMPTS, GREEDY, **CONFIG))
        if _swap_twice_onto_old_address(head):
            break
    else:
        pytest.skip("this allocator never handed the freed address out again")
    after = tokens(rollout.generate(model, PROMPTS, GREEDY, **CONFIG))
    assert after == fresh(model) != before


# --- a model of another architecture, junk bucket_bytes: refused, nothing changed -------------
@pytest.mark.parametrize("engine_model,source", [
    (("qwen2", {}), ("qwen2", {"num_hidden_layers": 1})),               # fewer layers
    (("qwen2", {}), ("qwen2", {"tie_word_embeddings": False})),         # untied head -> tied
    (("llama", {}), ("llama", {"tie_word_embeddings": True})),          # tied head -> untied
], ids=["fewer-layers", "untied-into-tied", "tied-into-untied"])
def test_a_model_of_another_architecture_is_refused(engine_model, source):
    """A trainer model that lacks weights the engine serves, or ties its head otherwise, is
    refused whole (it had been copied in part and counted as an update)."""
    model = tiny_model(engine_model[0], seed=0, **engine_model[1])
    engine = Engine(model, EngineConfig(**CONFIG))
    before = tokens(engine.generate(PROMPTS, GREEDY))
    with pytest.raises(ValueError, match=r"(update_weights: a model source must hold every "
                                         r"weight|model: its config has tie_word_embeddings)"):
        engine.update_weights(tiny_model(source[0], seed=1, **source[1]))
    assert (engine.weights_version, engine.needs_weights) == (0, False)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == before == fresh(model)


def test_junk_bucket_bytes_is_refused_before_anything_changes():
    """Where buckets are staged (the GPU path; its CPU seam here), junk bucket_bytes had
    reached the staging after the running requests went (needs_weights, a RuntimeError)."""
    model = tiny_model("qwen2", seed=0)
    engine = Engine(model, EngineConfig(**CONFIG, extra={"separate_host_memory": True}))
    for junk in ("x", None, [1], 0):
        with pytest.raises(ValueError, match="^bucket_bytes"):
            engine.update_weights(tiny_model("qwen2", seed=1), bucket_bytes=junk)
    assert (engine.weights_version, engine.needs_weights) == (0, False)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == fresh(model)


# --- a sleep failing after the memory went -----------------------------------------------------
@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
def test_a_sleep_failing_while_handing_memory_back_leaves_the_engine_asleep(kind, monkeypatch):
    """Handing the freed memory back fails (on a GPU, an earlier kernel's error surfacing at
    the synchronize): the pool and weights are gone, so the engine is asleep, and wakes."""
    model = tiny_model("qwen2", seed=0)
    engine = Engine(model, EngineConfig(**CONFIG))
    engine.generate(PROMPTS, GREEDY)

    def release():
        raise kind("handing the memory back")

    monkeypatch.setattr(colocation.host_heap, "release_freed_blocks", release)
    with pytest.raises(kind):
        engine.sleep(1)
    monkeypatch.undo()
    assert engine.is_sleeping and not engine.needs_weights
    engine.wake_up()
    engine.check_invariants()
    assert tokens(engine.generate(PROMPTS, GREEDY)) == fresh(model)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("release_fails", [False, True], ids=["released", "release-fails"])
def test_a_failed_wake_up_hands_back_the_memory_it_took(kind, release_fails, monkeypatch):
    """A wake-up failing after the pool and weights came back (here: putting carried K/V
    back) is asleep again, and hands the memory back as sleep does (one release per sleep,
    counted); a release failing then too leaves the wake-up's own error to be raised."""
    model = tiny_model("qwen2", seed=0)
    engine = Engine(model, EngineConfig(**CONFIG))
    released = []
    release = colocation.host_heap.release_freed_blocks

    def counted():
        released.append(engine.memory_held())
        if release_fails and len(released) > 1:
            raise RuntimeError("handing the memory back")
        release()

    monkeypatch.setattr(colocation.host_heap, "release_freed_blocks", counted)
    engine.sleep(1)
    asleep = engine.memory_held()

    def unpark():
        raise kind("waking")

    monkeypatch.setattr(engine.colocation._carried, "unpark", unpark)
    with pytest.raises(kind, match="waking") as raised:
        engine.wake_up()
    assert engine.is_sleeping and released == [asleep, asleep]
    notes = getattr(raised.value, "__notes__", [])
    assert notes == (["handing the memory back after it failed too: "
                      "RuntimeError('handing the memory back')"] if release_fails else [])
    monkeypatch.undo()
    engine.wake_up()
    engine.check_invariants()
    assert tokens(engine.generate(PROMPTS, GREEDY)) == fresh(model)


# --- ColocatedRollout after another wrote the engine -------------------------------------------
def test_colocated_rollout_syncs_again_after_another_wrote_the_engine():
    """Two wrappers share an engine (an evaluation model beside the policy), or the trainer
    called update_weights itself: the policy's next block copies its weights back."""
    policy, other = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    engine = Engine(policy, EngineConfig(**CONFIG))
    train, evaluate = ColocatedRollout(engine, policy), ColocatedRollout(engine, other, synced=False)
    for write in (lambda: evaluate.__enter__().__exit__(None, None, None),
                  lambda: (engine.wake_up(), engine.update_weights(other), engine.sleep(1))):
        write()
        with train as r:
            assert r.synced
            assert tokens(r.generate(PROMPTS, GREEDY)) == fresh(policy)
        with train as r:
            assert not r.synced
