"""rollout_recipes.algo.routing_replay: the training forward routes as the rollout did, and the flip
rate counts where it would not have (tiny fp32 MoE models, engine rollouts)."""

import copy
from types import SimpleNamespace

import pytest
import torch
from floors import assert_as_exact_as, exact_copy
from helpers import run_checked
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout_recipes.algo.batch import build_batch
from rollout_recipes.algo.routing_replay import (
    moe_routers,
    routed_expert_batch,
    routing_replay,
)

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [5, 99, 3, 100, 6, 7]]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def rollout(request):
    """(model, batch, routes): n=2 samples per prompt, the batch right-padded."""
    if request.param == "qwen3_moe":  # a dense layer first, top-k not renormalised
        model = tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0],
                           norm_topk_prob=False)
    else:
        model = tiny_model("mixtral")
    outs = rollout_outputs(model)
    batch = build_batch(outs, [0.0] * 2 * len(PROMPTS), 0, torch.device("cpu"))
    return model, batch, routed_expert_batch(outs, batch.input_ids.shape[1], model, 0)


def rollout_outputs(model):
    """n=2 seeded samples per prompt, with their routes (the same on every call)."""
    engine = Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64))
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1, logprobs=True,
                            return_routed_experts=True)
    return run_checked(engine, PROMPTS, params)


def forward(model, batch):
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                 use_cache=False).logits


def perturbed(model):
    """A copy whose routers route differently (the trainer a few steps past the rollout)."""
    other = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for router in moe_routers(other):
            router.weight.add_(torch.randn_like(router.weight))
    return other


def own_routes(model, batch) -> torch.Tensor:
    """[N, L, MoE layers, k] ids the model's routers pick in a plain forward."""
    ids = []
    hooks = [r.register_forward_hook(lambda m, a, out: ids.append(out[2]))
             for r in moe_routers(model)]
    try:
        with torch.no_grad():
            forward(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(ids, 1).view(*batch.input_ids.shape, len(ids), -1)


def test_the_batch_keeps_the_engines_int16_routes(rollout):
    """The training batch's routes are as wide as the engine's (int16): they were int64, 4x
    the memory on the trainer's device (Qwen3-30B-A3B: 48 MoE layers x top-8 = 3 KiB a token
    padded to the batch's longest row, 6 GiB for 512 rows of 4096 tokens)."""
    model, batch, routes = rollout
    assert routes.dtype == torch.int16
    outs = rollout_outputs(model)
    samples = [s for out in outs for s in out.samples]
    for row, sample in zip(routes, samples):
        assert torch.equal(row[:len(sample.routed_experts)], sample.routed_experts)
        assert (row[len(sample.routed_experts):] == -1).all()


def test_forced_experts_are_the_rollouts(rollout):
    model, batch, routes = rollout
    other = perturbed(model)
    used = []  # what each MoE block hands its experts: (hidden, top-k ids, top-k weights)
    experts = [m for name, m in other.named_modules() if name.endswith("mlp.experts")]
    hooks = [e.register_forward_pre_hook(lambda m, args: used.append(args[1])) for e in experts]
    with torch.no_grad(), routing_replay(other, routes) as count:
        forward(other, batch)
    for h in hooks:
        h.remove()
    used = torch.stack(used, 1).view(routes.shape)
    given = routes >= 0
    assert given.any() and (~given).any()  # padding and last tokens left alone
    assert torch.equal(used[given], routes[given])
    assert count.rate > 0.05  # the perturbed routers would have routed apart


def test_flip_rate_matches_a_naive_count(rollout):
    model, batch, routes = rollout
    with torch.no_grad(), routing_replay(model, routes, force=False) as count:
        forward(model, batch)
    assert count.rate == 0.0 and int(count.total) > 0

    other = perturbed(model)
    with torch.no_grad(), routing_replay(other, routes, force=False) as count:
        forward(other, batch)
    own = own_routes(other, batch)
    flipped = total = 0
    for n, l, layer in (routes[..., 0] >= 0).nonzero().tolist():
        total += 1
        flipped += set(own[n, l, layer].tolist()) != set(routes[n, l, layer].tolist())
    assert count.rate > 0 and int(count.total) == total
    assert int(count.flipped) == flipped


def test_replay_of_the_models_own_routes_changes_nothing(rollout):
    model, batch, routes = rollout
    exact = exact_copy(model)
    with torch.no_grad():
        plain = forward(model, batch)
        with routing_replay(model, routes):
            replayed = forward(model, batch)
        with routing_replay(exact, routes):  # the float64 answer routed as the rollout too
            truth = forward(exact, batch)
    valid = batch.attention_mask.bool()
    assert_as_exact_as(replayed[valid], truth[valid], plain[valid], "logits")


def test_gradients_reach_the_routers(rollout):
    model, batch, routes = rollout
    other = perturbed(model)
    with routing_replay(other, routes):
        logits = forward(other, batch)
        (logits.log_softmax(-1)[..., 0] * batch.attention_mask).sum().backward()
    for router in moe_routers(other):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
        assert router.weight.grad.isfinite().all()


def test_hooks_are_removed_on_exit_and_on_error(rollout):
    model, batch, routes = rollout
    routers = moe_routers(model)
    with routing_replay(model, routes):
        assert all(len(r._forward_hooks) == 1 for r in routers)
    assert all(not r._forward_hooks for r in routers)
    with pytest.raises(ValueError, match="not laid out like this batch"):
        with routing_replay(model, routes[:1]):
            forward(model, batch)
    assert all(not r._forward_hooks for r in routers)
    with pytest.raises(ValueError, match="MoE layers"):
        routing_replay(model, routes[:, :, :1]).__enter__()


def outputs_of(routes: torch.Tensor):
    """A RolloutOutput stand-in (what routed_expert_batch reads) holding `routes`' rows, all
    of weights version 0."""
    versions = torch.zeros(routes.shape[1], dtype=torch.int32)
    return [SimpleNamespace(samples=[SimpleNamespace(routed_experts=row, routed_versions=versions)
                                     for row in routes])]


def test_routes_of_another_router_size_are_refused(rollout):
    """Routes that cannot be this model's (other top-k, expert ids past its experts) are
    refused before any forward: an id past the experts failed in the forward with gather's
    RuntimeError (a device-side assert on CUDA), another top-k as a layout mismatch. The ids
    are checked by routed_expert_batch, on the host."""
    model, batch, routes = rollout
    length = routes.shape[1]
    experts = moe_routers(model)[0].num_experts
    with pytest.raises(ValueError, match=f"routes: expert ids up to {experts}, the model has "
                                         f"{experts} experts"):
        routed_expert_batch(outputs_of(torch.where(routes >= 0, routes + 1, routes)), length,
                            model, 0)
    top_1 = "routes: top-1 routing, the model's routers take the top 2"
    with pytest.raises(ValueError, match=top_1):
        routed_expert_batch(outputs_of(routes[..., :1]), length, model, 0)
    with pytest.raises(ValueError, match=top_1):
        with routing_replay(model, routes[..., :1]):
            forward(model, batch)


def test_entering_the_replay_reads_no_route(rollout):
    """routing_replay is entered for every training micro-batch: it checks the routes' shape
    only (it read their largest id, a blocking device-to-host copy each time on CUDA). A meta
    tensor has a shape and no values to read."""
    model, batch, routes = rollout
    with routing_replay(model, routes.to("meta")) as count:
        assert int(count.total) == 0


def test_custom_loop_logs_the_flip_rate_and_replays(tmp_path, monkeypatch):
    """The recipe's custom loop on a saved tiny Qwen3-MoE: moe/routing_flip_rate is 0 while
    the trainer still is the rollout's policy (one optimizer step per rollout) and turns
    positive once later minibatches train a moved policy; replay on or off."""
    from rollout_recipes.algo import custom_loop
    from rollout_recipes.grpo import main
    from rollout_recipes.run.tiny import char_tokenizer
    from rollout_recipes.tasks import REWARDS

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setitem(REWARDS, "math", lambda completion, answer: float(len(set(completion)) > 5))
    forced = []  # the loop's replays: forced or only counted

    def recorded(model, routes, force, count):
        forced.append(force)
        return routing_replay(model, routes, force, count)

    monkeypatch.setattr(custom_loop, "routing_replay", recorded)
    threads = torch.get_num_threads()
    tok = char_tokenizer("0123456789+=#abcdefghijklmnopqrstuvwxyz ?.\n")
    tiny_model("qwen3_moe", vocab_size=len(tok)).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    with open(tmp_path / "data.jsonl", "w") as f:
        f.writelines(f'{{"question": "what is {a}+{a}?", "answer": "{2 * a}"}}\n'
                     for a in range(40))
    args = ["--model", str(tmp_path / "model"), "--dataset", str(tmp_path / "data.jsonl"),
            "--prompt_template", "{question}", "--eval_size", "0", "--warmstart_steps", "0",
            "--steps", "2", "--prompts_per_step", "4", "--num_generations", "4",
            "--max_new_tokens", "8", "--kv_cache_tokens", "1024", "--max_model_len", "64",
            "--micro_batch_size", "8", "--num_threads", "1", "--wandb", "false",
            "--plot", "false", "--progress", "false", "--output_dir", str(tmp_path / "run")]
    try:
        on_policy = main(args + ["--routing_replay", "true"])["history"]
        assert [row["moe/routing_flip_rate"] for row in on_policy] == [0.0, 0.0]
        assert forced and all(forced)
        for replay in ("true", "false"):
            forced.clear()
            moved = main(args + ["--routing_replay", replay, "--minibatches", "2", "--epochs",
                                 "2", "--learning_rate", "1e-3"])["history"]
            assert all(row["moe/routing_flip_rate"] > 0 for row in moved)
            assert set(forced) == {replay == "true"}
    finally:
        torch.set_num_threads(threads)


def test_the_proximal_policy_is_the_replayed_one(rollout):
    """The decoupled objective's proximal logprobs come from forwards routed as the loss
    forward is (routing_replay forced; PPO's old values take the same path): with the same
    weights the ratio pi / pi_prox starts at 1, even where the trainer's own routing differs
    from the rollout's (a perturbed policy: carried tokens were routed by older weights)."""
    from rollout_recipes.algo.custom_loop import CustomTrainer
    from rollout_recipes.algo.logprobs import policy_logprobs

    model, batch, routes = rollout
    policy = perturbed(model)
    assert (own_routes(policy, batch) != routes).any()  # a plain forward routes otherwise
    trainer = CustomTrainer.__new__(CustomTrainer)  # only what _decouple reads
    trainer.module, trainer.routes = policy, routes
    trainer.cfg = SimpleNamespace(algo="grpo", temperature=1.0, micro_batch_size=4,
                                  routing_replay=True)
    trainer.acc = SimpleNamespace(device=torch.device("cpu"))
    batch = copy.deepcopy(batch)
    trainer._decouple(batch)
    with torch.no_grad(), routing_replay(policy, routes, True):
        loss_side = policy_logprobs(policy, batch.input_ids, batch.attention_mask, 1.0)
    gap = ((loss_side - batch.old_logprobs) * batch.mask).abs().max().item()
    # fp32 over other batch shapes: 0 and 2.4e-7 seen (AMD Zen 4, AVX-512), 0 and 0 (Intel
    # Xeon, AVX-512), the plain routing 2.3 and 7.6; AVX2: not measured; 1e-4 leaves room for
    # other ISAs
    assert gap < 1e-4, gap
