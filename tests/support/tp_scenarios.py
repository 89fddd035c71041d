"""What the tensor-parallel tests run, alike at TP=1 (in the pytest process, the reference) and
at TP=k (tests/support/tp_launch.py, on every rank): tiny models covering the sharding cases, each
scenario's (token ids, logprobs) per sample."""

from __future__ import annotations

import dataclasses
import random

import torch
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 40)), [42] * 9, [5, 99, 3, 100, 6, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=True)
SEEDED = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=6, logprobs=True, seed=5)
UNSEEDED = SamplingParams(n=2, temperature=1.0, max_tokens=8)
# Scored: two sharing a prompt (rows copied in a second round), one alone.
SCORED = [PROMPTS[2] + [1, 2, 3], PROMPTS[2] + [4, 5], PROMPTS[0]]
CONFIG = dict(kv_cache_tokens=1024, max_model_len=96, max_num_seqs=16,
              check_tensor_parallel=True)


def _random_biases(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


# name -> (model builder taking a seed). Heads 8 with 1, 2 or 4 KV heads: at TP=2 and TP=4
# the KV heads are split (more KV heads than ranks, or as many) or replicated (fewer).
MODELS = {
    # MQA: one KV head, replicated on every rank; untied head; o_proj and MLP biases.
    "llama_mqa": lambda seed: _random_biases(tiny_model(
        "llama", seed, num_attention_heads=8, num_key_value_heads=1, attention_bias=True,
        mlp_bias=True)),
    # GQA, 2 KV heads: split at TP=2, replicated at TP=4; untied.
    "llama_gqa2": lambda seed: tiny_model("llama", seed, num_attention_heads=8,
                                          num_key_value_heads=2),
    # GQA, 4 KV heads: split at TP=2 and 4; tied embeddings.
    "llama_gqa4_tied": lambda seed: tiny_model("llama", seed, num_attention_heads=8,
                                               num_key_value_heads=4, tie_word_embeddings=True),
    # QKV biases, tied, and a vocabulary no TP size divides (the last rank's rows padded).
    "qwen2_bias": lambda seed: _random_biases(tiny_model("qwen2", seed, vocab_size=130)),
    # Soft-capped logits and attention, sliding windows.
    "gemma2": lambda seed: tiny_model("gemma2", seed),
    # QKV and gate-up stored fused in the checkpoint: sliced part by part.
    "phi3": lambda seed: tiny_model("phi3", seed),
    # MoE: each expert's intermediate dimension sliced, the router replicated.
    "qwen3_moe": lambda seed: tiny_model("qwen3_moe", seed),
    "mixtral": lambda seed: tiny_model("mixtral", seed),
}


# The LoRA scenario's models (its adapters' targets as lora_models.TARGETS gives them).
LORA_MODELS = ("llama_mqa", "phi3", "qwen2_bias", "qwen3_moe", "mixtral")


def _samples(outs) -> list:
    return [[(s.token_ids, s.logprobs) for s in o.samples] for o in outs]


def run_all(tp: int) -> dict:
    """Scenario name -> per prompt, per sample (token ids, logprobs)."""
    results = {}
    cfg = dict(CONFIG, tensor_parallel_size=tp)
    for name, build in MODELS.items():
        engine = Engine(build(0), EngineConfig(**cfg))
        results[f"{name}/greedy"] = _samples(engine.generate(PROMPTS, GREEDY))
        results[f"{name}/seeded"] = _samples(engine.generate(PROMPTS, SEEDED))
        results[f"{name}/score"] = [[(o.token_ids, o.logprobs)] for o in engine.score(SCORED)]
        engine.check_invariants()
    if tp > 1:  # unseeded: the ranks agree on the engine's seed; no TP=1 counterpart
        results["unseeded"] = _samples(engine.generate(PROMPTS, UNSEEDED))
    results.update(_preemption(cfg))
    results.update(_speculation(cfg))
    results.update(_colocation(cfg))
    results.update(_carried_park(cfg))
    results.update(_lora(cfg))
    return results


def mismatched_requests(cfg: dict) -> dict:
    """Ranks of one engine handed different requests (rank r a prompt of 5 + 2r tokens): the
    step refuses on every rank before any forward mixes them, and once the caller aborts them
    the engine serves the same requests again as before; calls and engines that differ across
    ranks (below)."""
    engine = Engine(MODELS["llama_mqa"](0), EngineConfig(**cfg))
    before = _samples(engine.generate(PROMPTS, GREEDY))
    rank = torch.distributed.get_rank()
    engine.add_request(list(range(1, 6 + 2 * rank)), GREEDY)
    try:
        engine.step()
        refused = False
    except RuntimeError as e:
        refused = "run different requests" in str(e)
    engine.abort_all()
    engine.check_invariants()
    # Tokens: the prompts' K/V now come from the prefix cache, whose logits may differ from a
    # fresh prefill's in the last bits.
    # A call whose prompts or params differ across ranks (a rank handed no prompt at all had
    # returned at once while the others waited for it at their first step; a seed per rank
    # sampled differently without a word): refused on every rank before anything is queued.
    # (rank 0's rollout asks for a group of none: its own ValueError, the others told)
    calls = {"none": lambda: engine.generate(PROMPTS[:rank], GREEDY),
             "seed": lambda: engine.generate(PROMPTS[:1], dataclasses.replace(SEEDED, seed=rank)),
             "score": lambda: engine.score(SCORED[rank:]),
             "rollout": lambda: engine.rollout(PROMPTS[:rank], GREEDY, groups=1)}
    call_refused = {}
    for name, call in calls.items():
        try:
            call()
            call_refused[name] = False
        except RuntimeError as e:
            call_refused[name] = "queued different requests" in str(e)
        except ValueError as e:
            call_refused[name] = rank == 0 and str(e).startswith("groups:")
    engine.check_invariants()
    after = engine.generate(PROMPTS, GREEDY)
    # Engines built otherwise on each rank: a config field refused on every rank, naming it;
    # a pool each rank's memory would size differently takes the smallest on every one.
    try:
        Engine(MODELS["llama_mqa"](0), EngineConfig(**dict(cfg, seed=rank)))
        config_refused = False
    except ValueError as e:
        config_refused = str(e).startswith("seed: the ranks of a tensor-parallel engine")
    pool = Engine(MODELS["llama_mqa"](0),
                  EngineConfig(**dict(cfg, kv_cache_tokens=256 + 64 * rank))).pool.num_slots
    return {"mismatch/refused": refused,
            "mismatch/call_refused": call_refused,
            "mismatch/config_refused": config_refused, "mismatch/pool": pool,
            "mismatch/after": [[s.token_ids for s in o.samples] for o in after]
            == [[tokens for tokens, _ in o] for o in before]}


def failed_on_one_rank(cfg: dict) -> dict:
    """A sleep, wake-up and update that fail on the last rank only (out of memory, say): they
    fail on every rank, and every rank ends in one state (the deepest sleep any rank is in,
    needing weights if any lost them); the engine then goes on as before on every rank. Per
    case: (who raised: "last" on the last rank, "other rank" on the others; "sleep level /
    needs weights" after it). An update refused on every rank before any write changes nothing
    ("version / needs weights")."""
    engine = Engine(MODELS["llama_mqa"](0), EngineConfig(**cfg))
    before = _samples(engine.generate(PROMPTS, GREEDY))
    last = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    stack = engine.stack
    out = {}

    def fail_once(obj, name, error):
        real = getattr(obj, name)

        def failing(*args, **kwargs):
            setattr(obj, name, real)
            raise error
        if last:
            setattr(obj, name, failing)

    def attempt(case: str, call) -> None:
        try:
            call()
            who = "ok"
        except RuntimeError as e:
            who = "other rank" if "failed on another rank" in str(e) else "last"
        out[f"one_rank/{case}"] = [who, f"{engine.sleep_level}/{engine.needs_weights}"]

    # the last rank's sleep fails before it sleeps: awake there, asleep elsewhere -> asleep
    fail_once(stack.pool, "release", RuntimeError("pool release"))
    attempt("sleep", lambda: engine.sleep(1))
    engine.wake_up()
    # ... and at level 2: the others dropped their weights -> asleep at 2, needing weights
    fail_once(stack.pool, "release", RuntimeError("pool release"))
    attempt("sleep2", lambda: engine.sleep(2))
    engine.wake_up()
    engine.update_weights(MODELS["llama_mqa"](0))
    engine.sleep(1)
    fail_once(stack.pool, "allocate", RuntimeError("out of memory"))
    attempt("wake_up", engine.wake_up)
    engine.wake_up()
    fail_once(stack.model, "load_weights", RuntimeError("copy"))
    attempt("update", lambda: engine.update_weights(MODELS["llama_mqa"](0)))
    # ... from DTensor shards in many buckets, each exchanged by a collective over the mesh:
    # the failed rank joins the rest of them (it had stopped, and every rank waited forever)
    fail_once(stack.model, "load_weights", RuntimeError("copy"))
    attempt("update_dtensor", lambda: engine.update_weights(
        world_sharded(MODELS["llama_mqa"](0), 0), bucket_bytes=4096))
    out["one_rank/version"] = engine.weights_version
    engine.update_weights(MODELS["llama_mqa"](0))
    # refused on every rank before any write (another architecture: 2 KV heads, not 1): as on
    # one engine, nothing changes (every rank had been left needing weights)
    try:
        engine.update_weights(MODELS["llama_gqa2"](0))
    except ValueError:
        out["one_rank/refused"] = f"{engine.weights_version}/{engine.needs_weights}"
    engine.check_invariants()
    out["one_rank/after"] = _samples(engine.generate(PROMPTS, GREEDY)) == before
    return out


def _preemption(cfg: dict) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(128) for _ in range(rng.randrange(5, 20))] for _ in range(6)]
    # 12 tokens: 9 preemptions at TP=1 in 33 steps (20 tokens: 17 in 64).
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, logprobs=True, seed=3)
    engine = Engine(MODELS["llama_gqa2"](0),
                    EngineConfig(**dict(cfg, kv_cache_tokens=90, max_model_len=48)))
    outs = engine.generate(prompts, params)
    engine.check_invariants()
    return {"preempt/samples": _samples(outs), "preempt/count": engine.stats.preemptions > 0}


# Repetitive prompts give the n-gram drafter something to find.
SPEC_PROMPTS = [[1, 2, 3, 4, 5] * 3, list(range(10, 30)) * 2, [7, 8, 9]]


def _speculation(cfg: dict) -> dict:
    """n-gram and draft-model speculation on the KV-split target: the draft model (unsharded,
    replicated on every rank) the target itself, which gets most drafts accepted, and a small
    one with rejection acceptance. The tokens, and how many drafts were proposed and accepted,
    are those of one rank."""
    from rollout.spec import SpeculativeConfig

    target = MODELS["llama_gqa2"](0)
    draft = tiny_model("llama", 3, num_hidden_layers=1)
    out = {}
    for name, spec, params in [
            ("ngram", SpeculativeConfig("ngram", num_speculative_tokens=3), GREEDY),
            ("draft", SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=target),
             SEEDED),
            ("rejection", SpeculativeConfig("draft", num_speculative_tokens=3,
                                            draft_model=draft, acceptance="rejection"), SEEDED)]:
        engine = Engine(target, EngineConfig(**dict(cfg, speculative=spec)))
        out[f"spec/{name}"] = _samples(engine.generate(SPEC_PROMPTS, params))
        engine.check_invariants()
        out[f"spec/{name}/drafts"] = {"proposed": engine.stats.spec_proposed,
                                      "accepted": engine.stats.spec_accepted}
    # Adaptive lengths: the ranks draft alike (no per-rank step clock), the tokens one rank's.
    adaptive = SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=True)
    engine = Engine(target, EngineConfig(**dict(cfg, speculative=adaptive)))
    out["spec/adaptive"] = _samples(engine.generate(SPEC_PROMPTS, GREEDY))
    engine.check_invariants()
    return out


def _colocation(cfg: dict) -> dict:
    """Built from one model, then cycled through sleep levels and updated from another (full
    tensors, sliced per rank), in place."""
    a, b = MODELS["llama_mqa"](0), MODELS["llama_mqa"](1)
    engine = Engine(a, EngineConfig(**dict(cfg, extra={"separate_host_memory": True})))
    addresses = [p.data_ptr() for p in engine.model.parameters()]
    out = {}
    # Host memory is not the device's here (the CPU seam of rollout/colocation/parking.py), so every
    # tensor crosses in update_weights' buckets: what crossed must be this rank's parts only
    # (the vocabulary divides evenly: no padding rows).
    copied = engine.update_weights(b)["bytes"]
    out["update/copied_only_parts"] = copied == sum(
        p.numel() * p.element_size() for p in engine.model.parameters())
    out["update/awake"] = _samples(engine.generate(PROMPTS, GREEDY))
    out["update/same_addresses"] = addresses == [p.data_ptr() for p in engine.model.parameters()]
    engine.sleep(1)
    engine.wake_up()
    out["update/level1"] = _samples(engine.generate(PROMPTS, GREEDY))
    engine.sleep(2)
    engine.wake_up()
    engine.update_weights(a)
    out["update/level2"] = _samples(engine.generate(PROMPTS, SEEDED))
    return out


def _carried_park(cfg: dict) -> dict:
    """Partial rollouts with carried_kv="park" on the KV-split model: groups carried through a
    level-2 sleep (each rank parks its own heads' K/V) and an update to other weights, which
    they go on from their old K/V under (each rank keeps and tags its own)."""
    engine = Engine(MODELS["llama_gqa2"](0), EngineConfig(**dict(cfg, carried_kv="park")))
    params = [SamplingParams(n=2, temperature=1.0, max_tokens=4 + 4 * i, logprobs=True, seed=i)
              for i in range(len(PROMPTS))]
    outs = engine.rollout(PROMPTS, params, groups=1)
    engine.sleep(2)
    engine.wake_up()
    engine.update_weights(MODELS["llama_gqa2"](1))
    outs += engine.rollout(groups=1)
    kept = engine.stats.stale_kv_kept
    # The last rank fails to keep the carried K/V at the next update (after its copy): it
    # drops that K/V, and so does every rank (they had scheduled those samples apart), as
    # one engine does; a complete update follows.
    if engine.tp.rank == engine.tp.size - 1:
        keep_stale = engine.kv.keep_stale

        def failing(*args):
            engine.kv.keep_stale = keep_stale
            raise RuntimeError("keeping the carried K/V")
        engine.kv.keep_stale = failing
    try:
        engine.update_weights(MODELS["llama_gqa2"](0))
    except RuntimeError:
        pass
    engine.update_weights(MODELS["llama_gqa2"](0))
    outs += engine.rollout()
    engine.check_invariants()
    by_prompt = {tuple(o.prompt_token_ids): o for o in outs}
    return {"park/samples": _samples([by_prompt[tuple(p)] for p in PROMPTS]),
            "park/kept": kept > 0}


def _lora(cfg: dict) -> dict:
    """PEFT LoRA served unmerged (every projection targeted, and the MoE experts' stacks):
    column-parallel blocks hold the rank's rows of B, row-parallel ones its columns of A (the
    experts' gate-up its rows of B, their down its columns of A); then an adapter-only sync."""
    import peft
    from lora_models import DENSE, TARGETS, randomise_b

    out = {}
    for name in LORA_MODELS:
        family = name if name in TARGETS else "llama"
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                               target_modules=TARGETS.get(family, DENSE))
        model = peft.get_peft_model(MODELS[name](0), lora)
        randomise_b(model, seed=3)
        engine = Engine(model, EngineConfig(**cfg))
        out[f"lora/{name}/unmerged"] = engine.lora_status == "unmerged"
        out[f"lora/{name}/greedy"] = _samples(engine.generate(PROMPTS, GREEDY))
        randomise_b(model, seed=4)
        out[f"lora/{name}/adapter_only"] = engine.update_weights(model)["adapter_only"]
        out[f"lora/{name}/synced"] = _samples(engine.generate(PROMPTS, SEEDED))
    return out


def world_sharded(model, dim: int):
    """`model` with every parameter a DTensor Shard(dim) over the whole world (FSDP2-like;
    vectors Shard(0))."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.no_grad():
        for name, p in list(model.named_parameters()):
            module, attr = name.rsplit(".", 1)
            shard = distribute_tensor(p.detach(), mesh, [Shard(min(dim, p.dim() - 1))])
            setattr(model.get_submodule(module), attr, torch.nn.Parameter(shard))
    return model


def dtensor_update(cfg: dict) -> dict:
    """update_weights from DTensor shards over the world: Shard(0), then Shard(1) (so
    column-parallel rows come from column shards, row-parallel columns from row shards), each
    rank receiving only the ranges its part needs. Greedy outputs, to equal "update/awake" (the
    same weights, full), and what each update exchanged. Then Phi-3's fused QKV and gate-up
    (each rank's part made of ranges in several shards), Qwen2's vocabulary of 130 (uneven
    shards, padded rows) and Qwen3-MoE's stacked experts sharded along their cut's rows (which
    the layer names from the end), built from other weights, to equal their "<name>/greedy"."""
    engine = Engine(MODELS["llama_mqa"](0), EngineConfig(**cfg))
    out = {}
    for dim in (0, 1):
        cost = engine.update_weights(world_sharded(MODELS["llama_mqa"](1), dim))
        out[f"update/dtensor{dim}"] = _samples(engine.generate(PROMPTS, GREEDY))
        out[f"update/dtensor{dim}/cost"] = {k: cost[k] for k in ("collectives", "exchanged_bytes")}
    for name, dim in (("phi3", 0), ("qwen2_bias", 1), ("qwen3_moe", 1)):
        engine = Engine(MODELS[name](1), EngineConfig(**cfg))
        engine.update_weights(world_sharded(MODELS[name](0), dim))
        out[f"update/dtensor/{name}"] = _samples(engine.generate(PROMPTS, GREEDY))
    return out


def data_parallel(cfg: dict, tp: int) -> list:
    """Engines of `tp` ranks out of a larger world (data parallel x tensor parallel), built
    from other weights and updated from DTensor shards over the whole world (so a rank's mesh
    peers are not its engine's ranks): engine e greedy-decodes its data-parallel shard of the
    prompts, PROMPTS[e::engines]; compare with "llama_gqa2/greedy"."""
    import torch.distributed as dist

    engines = dist.get_world_size() // tp
    engine = Engine(MODELS["llama_gqa2"](1), EngineConfig(**dict(cfg, tensor_parallel_size=tp)))
    engine.update_weights(world_sharded(MODELS["llama_gqa2"](0), 0))
    return _samples(engine.generate(PROMPTS[dist.get_rank() // tp::engines], GREEDY))
