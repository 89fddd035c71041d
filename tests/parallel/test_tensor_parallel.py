"""Tensor parallelism (rollout/parallel/): engines of 2 and 4 CPU ranks (gloo, forked by
tests/support/tp_launch.py) give the tokens of one rank, with logprobs within 1e-4 in fp32, for every
sharding case (tests/support/tp_scenarios.py: KV heads split or replicated, biases, tied and untied
embeddings, a padded vocabulary, fused checkpoint tensors, soft-capping), seeded samples, a
small pool that preempts, n-gram and draft-model speculation, sleep / wake / update_weights
(with partial rollouts carried through them on their parked K/V too) from a full model (only each rank's part crossing to the "device") and from DTensor shards
on dim 0 and dim 1 (re-sharded without whole-weight gathers), and engines of 2 ranks side by
side in a world of 4; every rank returns the same outputs. The ranks check each step that they
sampled alike (check_tensor_parallel)."""

import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from tp_scenarios import LORA_MODELS, MODELS, run_all

from rollout import Engine, EngineConfig
from rollout.parallel import SINGLE, HeadSplit, TensorParallel, split_heads, split_vocab

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")


@pytest.fixture(scope="module")
def reference():
    return json.loads(json.dumps(run_all(1)))  # tuples as lists, like the ranks' JSON


def assert_close(got, want, where: str) -> None:
    for prompt_got, prompt_want in zip(got, want, strict=True):
        for (tokens, lps), (want_tokens, want_lps) in zip(prompt_got, prompt_want, strict=True):
            assert tokens == want_tokens, f"{where}: tokens differ from one rank's"
            err = max((abs(a - b) for a, b in zip(lps, want_lps)), default=0.0)
            # The ranks' all-reduces sum a row's partial products in another order than one
            # rank's matmul: float32 reassociation. Worst seen: 3.8e-6 (TP=2) and 4.8e-6
            # (TP=4) on AMD EPYC with AVX-512, 2026-12-01; 5.2e-6 (TP=2) and 4.8e-6 (TP=4) on
            # AMD EPYC Zen 3 (AVX2); 6.7e-6 (TP=2) and 5.7e-6 (TP=4) on Intel Xeon (AVX-512);
            # 1e-4 leaves ~15x for other ISAs.
            assert err < 1e-4, f"{where}: logprob error {err}"


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_one_rank(tp, reference, tmp_path):
    run = subprocess.run([sys.executable, os.path.join(SUPPORT, "tp_launch.py"), str(tmp_path),
                          str(tp)], capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(tp)]
    dp = [r.pop("dp/greedy", None) for r in ranks]
    one_rank = [{k: r.pop(k) for k in list(r) if k.startswith("one_rank/")} for r in ranks]
    for r, got in enumerate(ranks[1:], 1):
        assert got == ranks[0], f"rank {r} returned other outputs than rank 0"
    got = ranks[0]
    assert got["mismatch/refused"] and got["mismatch/after"]  # on every rank (equal above)
    assert got["mismatch/call_refused"] == {"none": True, "seed": True, "score": True,
                                            "rollout": True}
    assert got["mismatch/config_refused"] and got["mismatch/pool"] == 256
    # Failed on the last rank alone: every rank raised (the others saying so) and all ended
    # in one state (asleep at the deepest level, needing weights if any lost them; an update
    # counted on none), then went on as before.
    for r, failed in enumerate(one_rank):
        who = "last" if r == tp - 1 else "other rank"
        assert failed == {"one_rank/sleep": [who, "1/False"], "one_rank/sleep2": [who, "2/True"],
                          "one_rank/wake_up": [who, "1/False"], "one_rank/update": [who, "0/True"],
                          "one_rank/update_dtensor": [who, "0/True"],
                          "one_rank/version": 1, "one_rank/refused": "2/False",
                          "one_rank/after": True}, (r, failed)
    assert got["preempt/count"] and got["update/same_addresses"]
    assert got["park/kept"] and reference["park/kept"]
    assert got["update/copied_only_parts"] and reference["update/copied_only_parts"]
    for key, want in reference.items():
        if isinstance(want, list):
            assert_close(got[key], want, f"tp={tp} {key}")
        elif key.endswith("/drafts"):  # speculation proposed and accepted as on one rank
            assert got[key] == want, f"tp={tp} {key}"
    assert got["spec/draft/drafts"]["accepted"] > 0
    for name in LORA_MODELS:  # LoRA unmerged on every rank
        assert got[f"lora/{name}/unmerged"] and got[f"lora/{name}/adapter_only"]
    # DTensor sources: the same weights as "update/awake", each rank receiving less than a
    # whole-weight gather would bring it ((tp - 1) / tp of the model), in one bucket: one
    # exchange of what each rank needs and one all_to_all of the data.
    model_bytes = sum(p.numel() * p.element_size() for p in MODELS["llama_mqa"](1).parameters())
    for dim in (0, 1):
        assert_close(got[f"update/dtensor{dim}"], reference["update/awake"],
                     f"tp={tp} update/dtensor{dim}")
        cost = got[f"update/dtensor{dim}/cost"]
        assert cost["collectives"] == 2
        assert 0 < cost["exchanged_bytes"] < model_bytes * (tp - 1) / tp, cost
    for name in ("phi3", "qwen2_bias", "qwen3_moe"):
        assert_close(got[f"update/dtensor/{name}"], reference[f"{name}/greedy"],
                     f"tp={tp} update/dtensor/{name}")
    if tp >= 4:  # engines of 2 ranks: ranks 0-1 serve PROMPTS[0::2], ranks 2-3 PROMPTS[1::2]
        greedy = reference["llama_gqa2/greedy"]
        assert dp[0] == dp[1] and dp[2] == dp[3]
        assert_close(dp[0], greedy[0::2], "dp engine 0")
        assert_close(dp[2], greedy[1::2], "dp engine 1")


def test_head_and_vocab_splits():
    two, four = TensorParallel(2, 1), TensorParallel(4, 3)
    assert split_heads(8, 4, two) == HeadSplit(q_start=4, q_heads=4, kv_start=2, kv_heads=2)
    # Fewer KV heads than ranks: each rank keeps the KV head of its query heads.
    assert [split_heads(8, 2, TensorParallel(4, r)).kv_start for r in range(4)] == [0, 0, 1, 1]
    assert split_heads(8, 1, four).kv_heads == 1
    assert split_vocab(130, four) == (33, 99, 31)
    # A vocabulary too small for the ranks: the last holds padding rows only (it had begun
    # past the vocabulary, and its load raised on that rank alone).
    assert [split_vocab(5, TensorParallel(4, r)) for r in range(4)] == [
        (2, 0, 2), (2, 2, 2), (2, 4, 1), (2, 5, 0)]
    assert split_heads(8, 2, SINGLE).q_heads == 8
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide num_attention"):
        split_heads(6, 2, four)
    with pytest.raises(ValueError, match="num_key_value_heads=3 must divide it"):
        split_heads(12, 3, four)


def test_bad_tensor_parallel_size_is_refused():
    from models import tiny_model

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: torch.distributed is not"):
        Engine(tiny_model("llama"), EngineConfig(tensor_parallel_size=2))


@pytest.mark.parametrize("family,field", [("qwen3_moe", "moe_intermediate_size"),
                                          ("mixtral", "intermediate_size")])
def test_an_expert_size_the_ranks_cannot_split_is_refused_naming_its_field(family, field):
    import torch
    from models import tiny_model

    from rollout.models.loader import build_model

    config = tiny_model(family).config
    setattr(config, field, 49)
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2 must divide {field}=49"):
        build_model(config, 64, torch.float32, torch.device("cpu"), TensorParallel(2, 0))


def test_group_size_must_fit_the_world():
    from models import tiny_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the torch"):
            Engine(tiny_model("llama"), EngineConfig(tensor_parallel_size=2))
        with pytest.raises(ValueError, match="the process group given has 1 ranks"):
            Engine(tiny_model("llama"), EngineConfig(tensor_parallel_size=2),
                   process_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_slice_alike_from_stacked_and_per_expert_names(family):
    """Each rank's slice of every expert, from the stacked tensors and from per-expert names;
    the ranks' slices put back together are the full experts. No collective: only loading."""
    import torch
    from models import per_expert_tensors, tiny_model

    from rollout.colocation.weights import model_tensors
    from rollout.models.loader import build_model, load_into

    model = tiny_model(family)
    full = dict(model.named_parameters())
    gate_ups, downs = [], []
    for rank in range(2):
        tp = TensorParallel(2, rank)
        stacked, split = (build_model(model.config, 64, torch.float32, torch.device("cpu"), tp)
                          for _ in range(2))
        load_into(stacked, model_tensors(model))
        load_into(split, per_expert_tensors(model))
        for (name, a), (_, b) in zip(stacked.named_parameters(), split.named_parameters()):
            assert torch.equal(a, b), name
        experts = stacked.model.layers[0].mlp.experts
        gate_ups.append(experts.gate_up_proj.chunk(2, dim=1))
        downs.append(experts.down_proj)
    want = full["model.layers.0.mlp.experts.gate_up_proj"]
    gates, ups = (torch.cat([part[i] for part in gate_ups], 1) for i in range(2))
    assert torch.equal(torch.cat([gates, ups], 1), want)
    assert torch.equal(torch.cat(downs, 2), full["model.layers.0.mlp.experts.down_proj"])


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Shard(-1), Replicate()], ids=str)
@pytest.mark.parametrize("mesh_size", [2, 3, 4])
def test_reshard_pieces_assemble_every_rank_part(placement, mesh_size):
    """The geometry of the DTensor exchange (rollout/parallel/reshard.py), no collective: for
    each needing rank, the pieces every holder's shard contributes (uneven torch.chunk shards
    when the mesh size does not divide the dim) put together are its part of the full tensor,
    for a row slice, a column slice, a fused parameter's ranges and the whole tensor; a
    replicated tensor is read from the needing rank's own copy only."""
    from types import SimpleNamespace

    import torch

    from rollout.parallel import Concat, Slice
    from rollout.parallel.reshard import _chunk, _needs, _pieces, _region

    def shard(full, fake, holder):
        chunk = _chunk(fake, holder)
        return full if chunk is None else full.narrow(chunk[0], chunk[1], chunk[2] - chunk[1])

    # A matrix, and stacked experts [E, rows, cols], whose cuts name their dims from the end
    # as the MoE layer's do (Shard(1) then lies along a cut of dim -2).
    cases = [((10, 7), [None, Slice(0, 3, 5, 10), Slice(1, 2, 4, 7),
                        Concat((Slice(0, 1, 2, 4), Slice(0, 0, 3, 6)))]),
             ((3, 10, 7), [Slice(-2, 3, 5, 10), Slice(-1, 2, 4, 7),
                           Concat((Slice(-2, 1, 2, 4), Slice(-2, 0, 3, 6)), dim=-2)])]
    for shape, cuts in cases:
        full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
        fake = SimpleNamespace(shape=full.shape, dim=full.dim, placements=[placement],
                               device_mesh=SimpleNamespace(size=lambda: mesh_size))
        for cut in cuts:
            want = full if cut is None else cut.take(full)
            for needer in range(mesh_size):
                part = torch.full_like(want, float("nan"))
                for holder in range(mesh_size):
                    pieces = _pieces(fake, _needs(fake, cut), holder, needer)
                    if isinstance(placement, Replicate) and holder != needer:
                        assert not pieces
                    for src, dst in pieces:
                        _region(part, dst).copy_(_region(shard(full, fake, holder), src))
                assert torch.equal(part, want), (shape, cut, needer)


def test_a_group_this_rank_is_not_in_is_refused_saying_so():
    """dist.new_group hands the ranks outside the group GroupMember.NON_GROUP_MEMBER (an int,
    -100): passed on as process_group it was refused as 'got int', not as a group this rank
    is not in."""
    from rollout.parallel import tensor_parallel

    for size in (1, 2):
        with pytest.raises(ValueError, match="process_group: this rank is not a member"):
            tensor_parallel(size, dist.GroupMember.NON_GROUP_MEMBER)
