"""update_weights checks every source tensor before the first copy (a bad one raises ValueError
naming it and changes nothing), casts any floating dtype, and follows PEFT's adapter selection
(set_adapter, disable_adapter, modules_to_save) through rollout.generate and ColocatedRollout."""

import copy
import re

import pytest
import torch
from floors import FLOOR_MULTIPLE, token_logprobs
from models import tiny_model
from reference import assert_matches_reference
from test_dtensor_weights import one_rank_group  # noqa: F401  (fixture)
from torch import nn

import rollout
from rollout import Engine, EngineConfig, SamplingParams
from rollout.colocation.device_memory import tensor_bytes
from trainer_hooks import ColocatedRollout

CONFIG = dict(kv_cache_tokens=256, max_model_len=64)
PROMPT = [[3, 1, 4, 1, 5, 9, 2, 6]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=True)
# Late in the parameter order: most good tensors come before it.
TARGET = "model.layers.1.mlp.down_proj.weight"


def outputs(outs):
    return [(s.token_ids, s.logprobs) for o in outs for s in o.samples]


def fresh(model):
    return outputs(Engine(model, EngineConfig(**CONFIG)).generate(PROMPT, GREEDY))


def old_engine_and_new_model():
    return Engine(tiny_model("qwen2", seed=0), EngineConfig(**CONFIG)), tiny_model("qwen2", seed=7)


def assert_refused(engine, source, name: str, problem: str) -> None:
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match=f"weight {re.escape(repr(name))}: {problem}"):
        engine.update_weights(source)
    after = engine.model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in before.items())
    assert not engine.needs_weights


# --- a bad tensor is refused before anything is copied ---------------------------------------
BAD = {  # what spoils a good tensor, and the problem the error names
    "meta": (lambda t: torch.empty_like(t, device="meta"), "a meta tensor"),
    "int64": (lambda t: t.long(), "dtype torch.int64 is not floating point"),
    "bool": (lambda t: t > 0, "dtype torch.bool is not floating point"),
    "complex": (lambda t: t.to(torch.complex64), "dtype torch.complex64 is not floating point"),
    # a floating dtype, but the copy into the engine's dense weights would fail half way
    "sparse_coo": (lambda t: t.to_sparse(), "layout torch.sparse_coo is not dense"),
    "sparse_csr": (lambda t: t.to_sparse_csr(), "layout torch.sparse_csr is not dense"),
    "shape": (lambda t: t[:, :3], r"shape \(64, 3\), expected \(64, 128\)"),
    "non-tensor": (lambda t: t.numpy(), "expected a torch.Tensor, got ndarray"),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("container", ["dict", "pairs"])
@pytest.mark.parametrize("bad", BAD)
def test_bad_named_tensor_is_refused_before_any_copy(bad, container):
    spoil, problem = BAD[bad]
    engine, new = old_engine_and_new_model()
    named = [(n, spoil(p.detach()) if n == TARGET else p.detach())
             for n, p in new.named_parameters()]
    assert_refused(engine, dict(named) if container == "dict" else named, TARGET, problem)


@pytest.mark.parametrize("container", ["dict", "pairs"])
def test_unknown_name_is_refused_before_any_copy(container):
    engine, new = old_engine_and_new_model()
    bogus = "model.layers.1.mlp.bogus.weight"
    named = [(n, p.detach()) for n, p in new.named_parameters()]
    named.insert(len(named) - 1, (bogus, torch.zeros(3)))
    assert_refused(engine, dict(named) if container == "dict" else named, bogus,
                   "no such parameter")


def test_a_source_with_no_weight_is_refused_and_changes_nothing():
    """An exhausted iterator (the same named_parameters() generator given twice) or an empty
    dict: refused, the version, the weights and the prefix cache as they were (an update
    of nothing bumped the version and emptied the cache)."""
    engine, new = old_engine_and_new_model()
    engine.generate(PROMPT, GREEDY)
    pairs = new.named_parameters()
    engine.update_weights(pairs)
    version = engine.weights_version
    engine.generate(PROMPT, GREEDY)  # cached under the new weights
    cached = engine.cached_prefix_len(PROMPT[0])
    for empty in (pairs, {}):
        before = {n: t.clone() for n, t in engine.model.state_dict().items()}
        with pytest.raises(ValueError, match="update_weights: source holds no weight"):
            engine.update_weights(empty)
        assert engine.weights_version == version and not engine.needs_weights
        assert engine.cached_prefix_len(PROMPT[0]) == cached > 0
        after = engine.model.state_dict()
        assert all(torch.equal(after[n], t) for n, t in before.items())
    assert outputs(engine.generate(PROMPT, GREEDY)) == fresh(new)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("bad", ["meta", "int64", "bool", "complex", "sparse_coo", "sparse_csr"])
def test_bad_model_parameter_is_refused_from_its_metadata(bad):
    spoil, problem = BAD[bad]
    engine, new = old_engine_and_new_model()
    module = new.get_submodule(TARGET.rsplit(".", 1)[0])
    module.weight = nn.Parameter(spoil(module.weight.detach()), requires_grad=False)
    assert_refused(engine, new, TARGET, problem)


# --- floating dtypes are cast ----------------------------------------------------------------
@pytest.mark.parametrize("container", ["dict", "model"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_floating_sources_are_cast_to_the_engine_dtype(dtype, container):
    engine, new = old_engine_and_new_model()
    cast = copy.deepcopy(new).to(dtype)
    engine.update_weights(cast if container == "model" else dict(cast.named_parameters()))
    assert not engine.needs_weights
    got = outputs(engine.generate(PROMPT, GREEDY))
    # Exactly what the fp32 weights rounded through `dtype` give (float64 rounds nothing) ...
    assert got == fresh(copy.deepcopy(cast).float())
    # ... and as close to the fp32 weights' outputs as transformers' own forward of the cast
    # weights is to its forward of the fp32 ones, on the same tokens (the rounding's own effect;
    # parameters only: the engine builds its own rotary table, not the cast model's buffer).
    want = fresh(new)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    rounded = copy.deepcopy(new)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(dtype))
    for prompt, (ids, lps), (_, ref) in zip(PROMPT, got, want):
        moved = (token_logprobs(rounded, prompt, ids) - token_logprobs(new, prompt, ids)).abs()
        gap = (torch.tensor(lps, dtype=torch.float64) - torch.tensor(ref)).abs()
        assert gap.max().item() <= FLOOR_MULTIPLE * moved.max().item(), (gap.max(), moved.max())


@pytest.mark.parametrize("separate_host", [False, True], ids=["device", "bucketed"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_bytes_are_those_written_into_the_weights_whatever_the_source_dtype(dtype,
                                                                             separate_host):
    """`bytes` (and stats.weight_sync_bytes) is what the copy wrote into the engine's weights:
    a source tensor already on the device went in uncast, and had counted in its own dtype
    (twice the weights for a float64 source, half for a bf16 one), where a bucketed one
    counted as cast."""
    engine = Engine(tiny_model("qwen2", seed=0),
                    EngineConfig(**CONFIG, extra={"separate_host_memory": separate_host}))
    weights = tensor_bytes(engine.model.parameters())  # the tied head counted once
    info = engine.update_weights(tiny_model("qwen2", seed=7).to(dtype))
    assert info["bytes"] == engine.stats.weight_sync_bytes == weights


# --- a copy that fails midway ----------------------------------------------------------------
def fail_copies_after(engine, monkeypatch, count: int) -> None:
    """A device error no metadata check can foresee: load_weights raises once `count` tensors
    have been copied."""
    load, seen = engine.model.load_weights, []

    def flaky(bucket, **kwargs):
        seen.extend(bucket)
        if len(seen) > count:
            raise RuntimeError("simulated copy failure")
        return load(bucket, **kwargs)

    monkeypatch.setattr(engine.model, "load_weights", flaky)


def test_copy_failing_midway_leaves_the_callers_grad_mode_alone(monkeypatch):
    engine, new = old_engine_and_new_model()
    fail_copies_after(engine, monkeypatch, 3)
    with pytest.raises(RuntimeError) as failure:
        engine.update_weights(new)
    # The traceback keeps the suspended reader alive: a no_grad held across its yields would
    # still be in force here, and in the trainer's next backward.
    assert failure.value is not None and torch.is_grad_enabled()


def dora(model):
    """Two DoRA adapters active on a layer: read through PEFT's in-place merge (one alone is
    added out of place)."""
    peft = pytest.importorskip("peft")

    def config():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                               lora_dropout=0.0, use_dora=True)

    model = peft.get_peft_model(model, config())
    model.add_adapter("other", config())
    model.base_model.set_adapter(["default", "other"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("kind", ["model", "dora"])
def test_copy_failing_midway_leaves_the_engine_needing_a_full_update(kind, monkeypatch):
    engine, new = old_engine_and_new_model()
    if kind == "dora":
        new = dora(new)  # read through PEFT's in-place merge, held open while copying
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    fail_copies_after(engine, monkeypatch, 3)
    # A RuntimeError saying its weights are incomplete, needs_weights set (rather than serving
    # half-old, half-new weights), and the reader closed at once (else PEFT's merge stays in
    # the trainer's weights for as long as the traceback lives).
    with pytest.raises(RuntimeError, match="incomplete") as failure:
        engine.update_weights(new)
    assert failure.value is not None  # `failure` keeps the traceback, and the reader, alive
    assert not any(getattr(m, "merged", False) for m in new.modules())
    after = engine.model.state_dict()
    assert not all(torch.equal(after[n], t) for n, t in before.items())  # some were written
    assert engine.needs_weights
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPT, GREEDY)
    monkeypatch.undo()
    engine.update_weights(new)
    [(ids, lps)] = outputs(engine.generate(PROMPT, GREEDY))
    [(want_ids, want_lps)] = fresh(new)
    assert ids == want_ids
    if kind == "model":  # the new weights bit for bit, on an engine that has served nothing
        assert lps == want_lps
    else:  # every read of a DoRA model merges and unmerges, which moves its weights
        assert lps == pytest.approx(want_lps, abs=1e-5)



def test_a_failed_update_without_torch_distributed_reads_no_further(monkeypatch):
    """A Ctrl-C (or a copy failing) on an engine without torch.distributed stops the read of
    the source there: no DTensor exchange is waiting for this process, and the rest of a
    PEFT model's reading (a merge per layer) would have made the interrupt wait for all of it.
    Afterwards the engine needs a full update, which gives the new weights' outputs."""
    import rollout.colocation.colocation as colocation

    engine, new = old_engine_and_new_model()
    real, read = colocation.named_shapes_and_tensors, []

    def counted(source):
        shapes, named = real(source)

        def reading():
            for name, tensor in named:
                read.append(name)
                yield name, tensor
        return shapes, reading()
    monkeypatch.setattr(colocation, "named_shapes_and_tensors", counted)
    load = engine.model.load_weights

    def interrupted(bucket, **kwargs):
        load(bucket, **kwargs)
        raise KeyboardInterrupt
    monkeypatch.setattr(engine.model, "load_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.update_weights(new, bucket_bytes=1)  # a bucket a tensor
    assert len(read) <= 2 < len(new.state_dict()), read  # the one copied, one read ahead
    assert engine.needs_weights
    monkeypatch.undo()
    engine.update_weights(new)
    assert outputs(engine.generate(PROMPT, GREEDY)) == fresh(new)

# --- DTensor shards: checked without gathering, gathered while copying -----------------------
def shard(model, mesh, meta: str | None = None):
    """Every parameter as a one-rank DTensor shard; `meta`'s local shard holds no data."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    for name, p in list(model.named_parameters()):
        module_name, attr = name.rsplit(".", 1)
        if name == meta:
            dt = DTensor.from_local(torch.empty_like(p, device="meta"), mesh, [Shard(0)],
                                    run_check=False)
        else:
            dt = distribute_tensor(p.detach(), mesh, [Shard(0)])
        setattr(model.get_submodule(module_name), attr, nn.Parameter(dt, requires_grad=False))
    return model


def test_dtensor_with_meta_shard_is_refused_without_gathering(one_rank_group, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    engine, new = old_engine_and_new_model()
    sharded = shard(new, init_device_mesh("cpu", (1,)), meta=TARGET)
    gathers = []
    full_tensor = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor",
                        lambda self, **kw: gathers.append(1) or full_tensor(self, **kw))
    assert_refused(engine, sharded, TARGET, "a meta tensor")
    assert_refused(engine, dict(sharded.named_parameters()), TARGET, "a meta tensor")
    assert not gathers


def test_named_dtensor_shards_are_gathered_while_copying(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    engine, new = old_engine_and_new_model()
    want = fresh(new)
    sharded = shard(new, init_device_mesh("cpu", (1,)))
    engine.update_weights({n: p for n, p in sharded.named_parameters()})
    assert outputs(engine.generate(PROMPT, GREEDY)) == want


@pytest.mark.parametrize("lora_bias", [False, True], ids=["lora", "lora_bias"])
def test_lora_on_dtensor_shards_is_folded_in(lora_bias, one_rank_group):
    """FSDP2 shards a PEFT model's adapters as it shards its base: merged, each LoRA delta
    (B @ A, and B's bias) is a DTensor too, and adding it to the gathered base weight raised
    ("got mixed torch.Tensor and DTensor"), the whole update refused. Exactly what an engine
    built on PEFT's own merge of the unsharded model gives."""
    peft = pytest.importorskip("peft")
    from torch.distributed.device_mesh import init_device_mesh

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             lora_bias=lora_bias, init_lora_weights=False)  # (biased in qwen2)
    model = peft.get_peft_model(tiny_model("qwen2", seed=7), config)
    engine = Engine(tiny_model("qwen2", seed=0), EngineConfig(**CONFIG, lora="merged"))
    want = fresh(merged(model, "default"))
    engine.update_weights(shard(model, init_device_mesh("cpu", (1,))))
    assert outputs(engine.generate(PROMPT, GREEDY)) == want


@pytest.mark.parametrize("source", ["host buckets", "dtensor shards"])
def test_weights_read_through_peft_in_place_merge_are_taken_merged(source, one_rank_group):
    """A weight PEFT merges in place while it is read (two DoRA adapters active) is read as
    the merge leaves it; a bucket (host tensors bound for a GPU, DTensor shards re-sharded)
    held the weight itself and copied it only after the generator's end had unmerged it: the
    engine served those layers without their adapters (0.5 off), every check passing.
    Exactly what an engine built on PEFT's own merge gives (bucket_bytes=1 flushed in time)."""
    from torch.distributed.device_mesh import init_device_mesh

    new = dora(tiny_model("qwen2", seed=7))
    want = fresh(copy.deepcopy(new).merge_and_unload())
    extra = {"separate_host_memory": source == "host buckets"}
    engine = Engine(tiny_model("qwen2", seed=0), EngineConfig(**CONFIG, lora="merged",
                                                              extra=extra))
    if source == "dtensor shards":
        new = shard(new, init_device_mesh("cpu", (1,)))
    engine.update_weights(new)
    assert outputs(engine.generate(PROMPT, GREEDY)) == want


# --- PEFT: the active adapter, or none inside disable_adapter() -----------------------------
def two_adapter_model(family="qwen2", **lora):
    """(base, PEFT model with adapters 'default' and 'other' whose deltas differ)."""
    peft = pytest.importorskip("peft")
    base = tiny_model(family)

    def config():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                               lora_dropout=0.0, **lora)

    model = peft.get_peft_model(copy.deepcopy(base), config())
    model.add_adapter("other", config())
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # lora_B starts at zero (a no-op merge); modules_to_save copies start as the original.
            if "lora_B" in name or ".modules_to_save." in name:
                p.normal_(0, 0.5)
    return base, model


def merged(model, adapter: str):
    """What PEFT itself computes with `adapter` active, as a plain model."""
    model = copy.deepcopy(model)
    model.set_adapter(adapter)
    return model.merge_and_unload()


def expected(base, model):
    want = {"default": fresh(merged(model, "default")), "other": fresh(merged(model, "other")),
            None: fresh(base)}
    assert len({repr(v) for v in want.values()}) == 3  # the three are told apart
    return want


def check(outs, want, model, mode: str) -> None:
    """lora="merged": exactly an engine built on PEFT's merged model; "unmerged" (the
    default): the same tokens, logprobs as near `model`'s forward (PEFT's, with its selection
    now) as the reference's floor allows (reference.py)."""
    if mode == "merged":
        assert outputs(outs) == want
    else:
        assert [t for t, _ in outputs(outs)] == [t for t, _ in want]
        assert_matches_reference(model, PROMPT, outs)


@pytest.mark.parametrize("mode", ["merged", "unmerged"])
@pytest.mark.parametrize("lora", [{}, {"modules_to_save": ["lm_head"]}], ids=["lora", "saved"])
def test_generate_follows_set_adapter_and_disable_adapter(lora, mode):
    base, model = two_adapter_model("llama" if lora else "qwen2", **lora)
    want = expected(base, model)

    def generate():
        return rollout.generate(model, PROMPT, GREEDY, lora=mode, **CONFIG)

    check(generate(), want["default"], model, mode)
    model.set_adapter("other")
    check(generate(), want["other"], model, mode)
    with model.disable_adapter():
        check(generate(), want[None], model, mode)
    check(generate(), want["other"], model, mode)


@pytest.mark.parametrize("mode", ["merged", "unmerged"])
def test_colocated_rollout_follows_set_adapter_and_disable_adapter(mode):
    base, model = two_adapter_model()
    want = expected(base, model)
    engine = Engine(base, EngineConfig(lora=mode, **CONFIG))
    colocated = ColocatedRollout(engine, model, synced=False)

    def generate(adapter):
        with colocated as r:
            outs = r.generate(PROMPT, GREEDY)
        check(outs, want[adapter], model, mode)
        return r.synced

    assert generate("default")
    model.set_adapter("other")
    assert generate("other")
    with model.disable_adapter():
        assert generate(None)
    assert generate("other")
    assert not generate("other")  # the selection is stable between reads


@pytest.mark.parametrize("adapter, refused", [("default", True), ("other", False)])
def test_only_the_adapters_folded_in_are_checked(adapter, refused):
    """A meta LoRA weight is refused from metadata (nothing merged) when the read would fold it
    in, and ignored when its adapter is inactive."""
    base, model = two_adapter_model()
    engine = Engine(base, EngineConfig(**CONFIG))
    v_proj = model.base_model.model.model.layers[1].self_attn.v_proj
    lora_b = v_proj.lora_B[adapter]
    lora_b.weight = nn.Parameter(torch.empty_like(lora_b.weight, device="meta"))
    if refused:
        assert_refused(engine, model, f"model.layers.1.self_attn.v_proj.lora_B.{adapter}.weight",
                       "a meta tensor")
        assert not any(getattr(m, "merged", False) for m in model.modules())
    else:
        engine.update_weights(model)
        reference = merged(model, "default")  # PEFT's model holds a meta tensor: a plain copy
        check(engine.generate(PROMPT, GREEDY), fresh(reference), reference, engine.config.lora)
