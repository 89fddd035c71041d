"""The GPU-only colocation paths, run on CPU through a seam.

On a GPU, sleep(1) copies the weights into host buffers and frees the device's, wake_up copies
them back, and update_weights moves the trainer's host tensors in flat buckets (weights.buckets'
flush). On CPU none of that runs: host memory is the device's, so level 1 leaves the weights in
place and every source tensor is already on the engine's device. `EngineConfig(extra=
{"separate_host_memory": True})` makes a CPU engine treat its memory as separate from the host's
(rollout/colocation/parking.py): the same parking code runs, with host-to-host copies. These tests check what
a cycle holds (memory_held, the parked host bytes, which storages the parameters use) and what
it generates, after every cycle, at levels 1 and 2 and deepening from 1 to 2.

The `bucketed` fixture wraps the `buckets` update_weights calls, only to record each bucket.
"""

import sys

import pytest
import torch
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.colocation import weights as weights_module
from rollout.colocation.colocation import Colocation
from rollout.colocation.device_memory import tensor_bytes
from rollout.config import SEPARATE_HOST_MEMORY
from rollout.spec import SpeculativeConfig

CONFIG = dict(kv_cache_tokens=512, max_model_len=64, max_num_seqs=16)
SEAM = {SEPARATE_HOST_MEMORY: True}
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [1, 2, 3, 4, 5, 6, 10, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=True)
SEEDED = SamplingParams(n=3, temperature=0.9, max_tokens=8, logprobs=True, seed=5)


def run(engine):
    outs = engine.generate(PROMPTS, GREEDY) + engine.generate(PROMPTS, SEEDED)
    engine.check_invariants()
    return [[(s.token_ids, s.logprobs) for s in o.samples] for o in outs]


def fresh(model, **config):
    """What a plain engine (no seam, never asleep) generates from these weights."""
    return run(Engine(model, EngineConfig(**CONFIG, **config)))


def seam_engine(model, **config) -> Engine:
    return Engine(model, EngineConfig(**CONFIG, extra=SEAM, **config))


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.fixture
def bucketed(monkeypatch):
    """update_weights through the flushes of weights.buckets; returns a record of each bucket
    as (names, storage addresses of its tensors, bytes)."""
    record = []

    def every_tensor_bucketed(named, device, dtype, bucket_bytes, separate_host):
        assert separate_host, "update_weights must pass the seam's flag"
        for bucket in weights_module.buckets(named, device, dtype, bucket_bytes,
                                             separate_host=separate_host):
            record.append(([n for n, _ in bucket], {ptr(t) for _, t in bucket},
                           sum(t.numel() * t.element_size() for _, t in bucket)))
            yield bucket

    # Where update_weights looks `buckets` up: the module that defines it.
    caller = sys.modules[Colocation.update_weights.__module__]
    monkeypatch.setattr(caller, "buckets", every_tensor_bucketed)
    return record


def test_the_seam_is_off_by_default_and_checked():
    engine = Engine(tiny_model("qwen2"), EngineConfig(**CONFIG))
    assert not engine.stack.parking.separate_host
    engine.sleep(1)  # a plain CPU engine keeps its weights in place at level 1
    assert engine.stack.parking.host_bytes == 0
    assert engine.memory_held() == tensor_bytes(engine.model.parameters()) > 0
    with pytest.raises(ValueError, match="separate_host_memory"):
        Engine(tiny_model("qwen2"), EngineConfig(**CONFIG, extra={SEPARATE_HOST_MEMORY: "yes"}))


def test_level1_parks_weights_in_host_buffers_and_restores_them_every_cycle(bucketed):
    model = tiny_model("qwen2")
    want = fresh(model)
    engine = seam_engine(model)
    parking = engine.stack.parking
    assert parking.separate_host
    weights = tensor_bytes(engine.model.parameters())
    assert run(engine) == want
    awake = engine.memory_held()
    assert awake > weights
    params = dict(engine.model.named_parameters())
    for cycle in range(3):
        # Held here, the old storages cannot be reused, so their addresses identify them.
        old = {n: p.data for n, p in params.items()}
        engine.sleep(1)
        engine.check_invariants()
        assert engine.memory_held() == 0, cycle  # the weights left the "device"
        assert parking.host_bytes == weights
        host = dict(parking.host)
        assert host.keys() == params.keys()
        for name, p in params.items():
            assert p.numel() == 0
            assert ptr(host[name]) != ptr(old[name]) and torch.equal(host[name], old[name])
        engine.wake_up()
        assert parking.host_bytes == 0 and engine.memory_held() == awake
        assert dict(engine.model.named_parameters()) == params  # the same Parameter objects
        for name, p in params.items():
            # A new device tensor, neither the old one nor the host buffer (now freed).
            assert ptr(p) not in (ptr(old[name]), ptr(host[name]))
            assert torch.equal(p, old[name])
        del old, host
        assert run(engine) == want, cycle
    assert not bucketed  # no update_weights in these cycles


def test_cycles_at_both_levels_with_updates_between(bucketed):
    """Level 1, level 2, 1 deepened to 2, level 1 again; the trainer's weights change between
    cycles and each update goes through the bucketed flush."""
    model = tiny_model("qwen2")
    engine = seam_engine(model)
    parking = engine.stack.parking
    weights = tensor_bytes(engine.model.parameters())
    run(engine)
    awake = engine.memory_held()
    for cycle, levels in enumerate([(1,), (2,), (1, 2), (1,)]):
        for level in levels:
            engine.sleep(level)
            engine.check_invariants()
            assert engine.memory_held() == 0
            assert parking.host_bytes == (weights if level == 1 else 0)
        assert engine.needs_weights == (levels[-1] == 2)
        engine.wake_up()
        assert parking.host_bytes == 0
        if engine.needs_weights:
            with pytest.raises(RuntimeError, match="update_weights"):
                engine.generate(PROMPTS, GREEDY)
        model = tiny_model("qwen2", seed=10 + cycle)  # the trainer's next policy
        bucketed.clear()
        info = engine.update_weights(model, bucket_bytes=32 << 10)
        assert len(bucketed) > 1 and info["bytes"] == sum(b for *_, b in bucketed) == weights
        assert engine.memory_held() == awake  # the flat buckets were not kept
        assert run(engine) == fresh(model), cycle


def test_bucketed_update_copies_every_tensor_through_flat_buckets(bucketed):
    old, new = tiny_model("qwen2"), tiny_model("qwen2", seed=7)
    engine = seam_engine(old)
    run(engine)
    awake = engine.memory_held()
    source = {n: p.detach() for n, p in new.named_parameters()}
    sources = {ptr(t) for t in source.values()}
    bucket_bytes = 16 << 10
    engine.update_weights(source, bucket_bytes=bucket_bytes)
    names = [n for ns, _, _ in bucketed for n in ns]
    assert sorted(names) == sorted(source)  # every tensor, each once
    for ns, storages, nbytes in bucketed[:-1]:
        # One flat buffer per bucket (a copy, not the trainer's tensors), filled to the limit.
        assert len(storages) == 1 and not storages & sources
        assert nbytes >= bucket_bytes
    assert run(engine) == fresh(new)
    assert engine.memory_held() == awake
    # A float64 source is cast to the engine's dtype inside the flush; fp32 values survive it.
    bucketed.clear()
    engine.update_weights({n: t.double() for n, t in source.items()}, bucket_bytes=bucket_bytes)
    assert all(len(storages) == 1 for _, storages, _ in bucketed)
    assert run(engine) == fresh(new)


def test_buckets_pass_device_tensors_through_unless_the_host_is_separate():
    named = [(f"w{i}", torch.full((100,), float(i))) for i in range(5)]
    cpu = torch.device("cpu")
    direct = list(weights_module.buckets(iter(named), cpu, torch.float32, 1 << 10))
    assert [[id(t) for _, t in b] for b in direct] == [[id(t)] for _, t in named]  # as given
    flat = list(weights_module.buckets(iter(named), cpu, torch.float16, 1 << 10,
                                       separate_host=True))
    assert [len(b) for b in flat] == [3, 2]  # 1200 bytes >= 1 KiB closes the first bucket
    for bucket in flat:
        assert len({ptr(t) for _, t in bucket}) == 1
        for name, t in bucket:
            assert t.dtype == torch.float16 and torch.equal(t.float(), dict(named)[name])


def test_draft_model_stack_parks_through_the_seam_too():
    model, draft = tiny_model("qwen2"), tiny_model("qwen2", seed=3, num_hidden_layers=1)
    spec = dict(speculative=SpeculativeConfig("draft", num_speculative_tokens=3,
                                              draft_model=draft))
    want = fresh(model, **spec)
    engine = seam_engine(model, **spec)
    draft_parking = engine.speculator.drafter.stack.parking
    assert run(engine) == want
    for _ in range(2):
        engine.sleep(1)
        assert draft_parking.host_bytes == tensor_bytes(draft.parameters())
        assert engine.memory_held() == 0
        engine.wake_up()
        assert draft_parking.host_bytes == 0
        assert run(engine) == want


def _failing_after(module, count: int):
    """module.named_parameters yields `count` parameters, then raises, the first time only: a
    park or restore that fails half way, with some weights moved and the rest not (the
    engine's way back then walks every parameter)."""
    real, calls = module.named_parameters, []

    def named_parameters(*args, **kwargs):
        calls.append(1)
        for i, item in enumerate(real(*args, **kwargs)):
            if i == count and len(calls) == 1:
                raise RuntimeError("injected")
            yield item

    return named_parameters


def test_park_and_restore_failing_half_way_with_real_host_copies(monkeypatch):
    model = tiny_model("qwen2")
    want = fresh(model)
    engine = seam_engine(model)
    parking = engine.stack.parking
    run(engine)
    awake = engine.memory_held()
    # sleep(1) fails after 3 weights went to the host: the engine wakes them back up.
    monkeypatch.setattr(engine.model, "named_parameters", _failing_after(engine.model, 3))
    with pytest.raises(RuntimeError, match="injected"):
        engine.sleep(1)
    monkeypatch.undo()
    assert not engine.is_sleeping and not engine.needs_weights
    assert parking.host_bytes == 0 and engine.memory_held() == awake
    assert run(engine) == want
    # wake_up fails after restoring 3 weights: the engine parks them again and stays asleep.
    engine.sleep(1)
    monkeypatch.setattr(engine.model, "named_parameters", _failing_after(engine.model, 3))
    with pytest.raises(RuntimeError, match="injected"):
        engine.wake_up()
    monkeypatch.undo()
    assert engine.is_sleeping and engine.memory_held() == 0
    assert parking.host_bytes == tensor_bytes(model.parameters())
    engine.wake_up()
    assert engine.memory_held() == awake and run(engine) == want
