"""The engine on the Triton backend (interpreter on CPU) against the torch reference backend,
and its shared-prefix decode path (samples of one prompt read the prompt's K/V once)."""

import pytest
import torch
from kernels_env import DEVICE, ON_GPU
from models import tiny_model
from reference import assert_matches_reference, assert_paths_agree
from test_torch_shared_prefix import assert_attention_exact

from rollout import Engine, EngineConfig, SamplingParams
from rollout.attention import triton as triton_attention
from rollout.attention.metadata import AttentionMetadata
from rollout.attention.registry import attention_name
from rollout.attention.sdpa import TorchAttention
from rollout.attention.triton import TritonAttention, TritonPlan
from rollout.kv.pool import KVPool
from rollout.ops.backend import resolve_backend
from rollout_kernels.triton import shared_prefix_attention

pytestmark = pytest.mark.interpreter


def generate_on_both_backends(prompts, params, **overrides):
    outs = {}
    for backend in ("torch", "triton"):
        config = EngineConfig(kv_cache_tokens=512, max_model_len=64, backend=backend,
                              **overrides)
        engine = Engine(tiny_model("qwen3").to(DEVICE), config)
        outs[backend] = engine.generate(prompts, params)
        engine.check_invariants()
    # On the CPU each path to the float64 floor; a GPU forward is no float32 CPU reference, so
    # there a fixed bound (reference.py), not measured here: the machines measured on (AMD
    # EPYC Zen 3, AVX2; Intel Xeon, AVX-512) have no GPU.
    assert_paths_agree(tiny_model("qwen3").to(DEVICE), prompts, params, outs["torch"],
                       outs["triton"], atol=1e-4 if ON_GPU else None)


def test_triton_backend_matches_torch_backend():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12] * 5]
    params = SamplingParams(n=2, temperature=0.8, max_tokens=6, logprobs=True, seed=1)
    generate_on_both_backends(prompts, params, max_num_batched_tokens=9)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's case: compiled, the kernels run bf16")
def test_interpreter_leaves_bf16_to_torch_attention():
    """The interpreter's bf16 tl.dot is wrong (tests/support/kernels_env.py): a bf16 model's
    attention falls back to torch's, whose logprobs are transformers' (the Triton kernels were
    5.9 nats off); fp16 and fp32 keep the kernels. The batch-invariant mode, which has no
    fallback, refuses."""
    backend = resolve_backend("triton", torch.device("cpu"))
    assert [attention_name(backend, dtype) for dtype in
            (torch.float32, torch.float16, torch.bfloat16)] == ["triton", "triton", "torch"]
    model = tiny_model("qwen3", dtype=torch.bfloat16)
    engine = Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64, backend="triton"))
    assert engine.implementations()["attention"] == "torch"
    prompts = [list(range(1, 11)), [12] * 5]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=True))
    # bf16 against transformers' bf16 forward: a bound of a few bf16 roundings of a logprob.
    assert_matches_reference(model, prompts, outs, atol=0.25, greedy=False)
    with pytest.raises(ValueError, match="Triton attention does not run torch.bfloat16"):
        Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64, backend="triton",
                                   batch_invariant=True))


def test_samples_of_a_prompt_decode_through_the_shared_prefix(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["max_group_size"])
        return shared_prefix_attention(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "shared_prefix_attention", counted)
    system = list(range(1, 25))  # longer than a tile under the interpreter (16 positions)
    prompts = [system + [30, 31, 32], system + [40, 41], [50] * 18]
    params = SamplingParams(n=4, temperature=0.8, max_tokens=6, logprobs=True, seed=3)
    generate_on_both_backends(prompts, params)
    assert calls and max(calls) == 4


def decode_step(pool, requests, seed=0):
    """Metadata and q/k/v of a decode step; requests: (group, shared_len, kv_len). A group's
    first shared_len context slots are the same for all its requests, the rest are private."""
    gen = torch.Generator().manual_seed(seed)
    free = iter(torch.randperm(pool.num_slots, generator=gen).tolist())
    prefixes, kv_indices = {}, []
    for group, shared, kv_len in requests:
        prefix = prefixes.setdefault(group, [next(free) for _ in range(shared)])
        kv_indices.append(prefix[:shared] + [next(free) for _ in range(kv_len - shared)])
    num_req = len(requests)
    kv_lens = [kv_len for _, _, kv_len in requests]
    meta = AttentionMetadata(
        qo_indptr=torch.arange(num_req + 1, dtype=torch.int32, device=DEVICE),
        kv_indptr=torch.tensor([0] + kv_lens).cumsum(0).to(DEVICE, torch.int32),
        kv_indices=torch.tensor([s for slots in kv_indices for s in slots], device=DEVICE),
        out_slots=torch.tensor([slots[-1] for slots in kv_indices], device=DEVICE),
        q_lens=[1] * num_req, kv_lens=kv_lens, groups=[g for g, _, _ in requests],
        shared_lens=[s for _, s, _ in requests])
    q = torch.randn(num_req, 4, 32, generator=gen).to(DEVICE)
    k, v = torch.randn(2, num_req, pool.kv_heads, 32, generator=gen).to(DEVICE)
    return meta, q, k, v


def test_shared_prefix_path_matches_torch_backend_on_interleaved_groups():
    """Groups interleaved in the batch (rows permuted and back), a group of one with a shared
    length and a request with none (both read alone), prefixes across several tiles."""
    pool = KVPool(1, 300, 2, 32, torch.float32, DEVICE)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(1)))
    requests = [("a", 20, 23), ("b", 9, 10), ("a", 20, 41), ("d", 0, 17), ("b", 9, 25),
                ("c", 5, 12), ("a", 20, 21)]
    meta, q, k, v = decode_step(pool, requests)
    outs = []
    for backend in (TorchAttention(pool), TritonAttention(pool)):
        meta.plan = backend.plan(meta)
        outs.append(backend.forward(q, k, v, 0, meta, 32 ** -0.5))
    plan = meta.plan.shared
    assert plan.perm.tolist() == [0, 2, 6, 1, 4, 3, 5]
    assert plan.group_indptr.tolist() == [0, 3, 5, 6, 7]
    # a, b, then d and c alone: all their context but the new token
    assert plan.prefix_indptr.tolist() == [0, 20, 29, 45, 56]
    assert_attention_exact(outs[1], pool, meta, q, floor=outs[0])  # the torch backend's floor


def test_plain_kernel_when_nothing_is_shared():
    pool = KVPool(1, 100, 2, 32, torch.float32, DEVICE)
    backend = TritonAttention(pool)
    # Every group of one, or sharing nothing yet: the plain paged kernel's plan.
    for requests in ([("a", 5, 9), ("b", 5, 7)], [("a", 0, 9), ("a", 0, 7), ("b", 4, 6)]):
        meta, *_ = decode_step(pool, requests)
        assert backend.plan(meta) == TritonPlan(1, 9)
    meta, *_ = decode_step(pool, [("a", 5, 9), ("a", 5, 7)])
    meta.q_lens = [1, 2]  # a verify (or prefill) row: not decode-only
    assert backend.plan(meta) == TritonPlan(2, 9)
