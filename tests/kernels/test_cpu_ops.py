"""The C kernels as torch operators (rollout_kernels/cpu/ops.py): their schemas and fake
functions checked by torch.library.opcheck, their names in the profiler's events of an engine
run, torch.compile tracing them in one graph, and the eager path that calls the C directly."""

import pytest
import torch
from models import tiny_model
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from rollout import Engine, EngineConfig, SamplingParams
from rollout_kernels import cpu as native
from rollout_kernels.cpu import (checked_copy, gumbel, linear, linear_amx, norm_rope,
                                 paged_attention, radix_sort, silu_mul, top_p_prefix)
from rollout_kernels.cpu.ops import watched

pytestmark = pytest.mark.skipif(not native.has("rms_norm_f32", "paged_attention_f32"),
                                reason=native.missing_reason("rms_norm_f32",
                                                             "paged_attention_f32"))
needs_panels = pytest.mark.skipif(not linear.supported(torch.device("cpu"), torch.float32),
                                  reason=native.missing_reason("linear_f32"))
needs_gumbel = pytest.mark.skipif(not gumbel.supported(torch.device("cpu"), torch.float32),
                                  reason=native.missing_reason("gumbel_argmax_f32"))


def attention_args(store: bool):
    """The paged_attention operator's arguments: two requests (3 and 1 query rows) over 5 and 7
    slots of a 16-slot pool, 4 query heads on 2 KV heads of 8; `store`: the 4 new K/V rows go
    to slots 12-15 first."""
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool = (torch.randn(16, 2, 8, generator=gen) for _ in range(2))
    q = torch.randn(4, 4, 8, generator=gen)
    kv_indices = torch.tensor([0, 1, 2, 12, 13, 3, 4, 5, 6, 7, 8, 14])
    rows = paged_attention.NativeRows.of([0, 1], [0, 3], [3, 1], [0, 5], [5, 7], kv_indices)
    chunks = rows.chunks(2, torch.get_num_threads())
    if store:
        k_new, v_new = (torch.randn(4, 2, 8, generator=gen) for _ in range(2))
        slots = torch.tensor([12, 13, 14, 15])
    else:
        k_new = v_new = slots = torch.empty(0)
    return (q, k_pool, v_pool, torch.empty(4, 4, 8), rows.q_start, rows.q_len, rows.kv_start,
            rows.kv_len, rows.kv_indices, chunks.first, chunks.count, chunks.prefix, 8 ** -0.5,
            0, 0.0, k_new, v_new, slots, False)


def samples():
    """(operator, its arguments) for every kernel this CPU builds."""
    gen = torch.Generator().manual_seed(1)
    x, delta = torch.randn(5, 24, generator=gen), torch.randn(5, 24, generator=gen)
    weight = torch.randn(24, generator=gen)
    q, k = torch.randn(3, 4, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    angle = torch.randn(3, 1, 16, generator=gen)
    out = [(norm_rope.rms_norm, (x, weight, 1e-6)),
           (norm_rope.add_rms_norm, (x, delta, weight, 1e-6)),
           (norm_rope.rotary_, (q, k, angle.cos(), angle.sin())),
           (silu_mul.silu_mul, (x, delta)),
           (paged_attention.attend, attention_args(store=False)),
           (paged_attention.attend, attention_args(store=True)),
           (checked_copy.copy_with_sums, (torch.empty(5, 24), x)),
           (radix_sort.sort_rows, (torch.randint(-2**31, 2**31 - 1, (3, 40), generator=gen,
                                                 dtype=torch.int32),)),
           (top_p_prefix.prefix_lengths, (x.softmax(-1).sort(descending=True).values,
                                          torch.tensor([24, 3, 24, 24, 1]), torch.full((5,), 0.7),
                                          24))]
    if linear.supported(torch.device("cpu"), torch.float32):
        w = torch.randn(40, 24, generator=gen)
        out += [(linear.linear, (x, linear.pack_panels(w), 40)),
                (linear.linear_add, (x, linear.pack_panels(w), torch.zeros(5, 40), 0.5))]
    if linear_amx.supported(torch.device("cpu")):
        w = torch.randn(40, 24, generator=gen).bfloat16()
        out.append((linear_amx.linear, (x.bfloat16(), linear_amx.pack_panels(w), 40, 24)))
    if gumbel.supported(torch.device("cpu"), torch.float32):
        out.append((gumbel.gumbel_argmax, (torch.randn(3, 50, generator=gen),
                                           torch.tensor([1, 2, 3], dtype=torch.int32))))
    return out


def cases():
    """samples() as test parameters named by their operators."""
    return [pytest.param(kernel, args, id=f"{kernel.op.name()}-{i}")
            for i, (kernel, args) in enumerate(samples())]


def clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("kernel, args", cases())
def test_the_operator_schemas_hold(kernel, args):
    # Each schema's mutations, its fake function against the kernel's outputs, and a traced
    # graph with dynamic shapes (what torch.compile builds), checked by torch itself.
    torch.library.opcheck(kernel.op, clone(args))


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("kernel, args", cases())
def test_the_operator_is_the_direct_call_bit_for_bit(kernel, args):
    direct, dispatched = clone(args), clone(args)
    assert same(kernel(*direct), kernel.op(*dispatched))
    assert same(direct, dispatched)  # what each wrote into its arguments


def test_a_bad_store_slot_raises_through_the_operator():
    args = list(attention_args(store=True))
    args[17] = torch.tensor([12, 13, 14, 16])  # the pool has 16 slots
    for call in (paged_attention.attend, paged_attention.attend.op):
        with pytest.raises(IndexError, match="slot 16 of token 3 is past the pool's 16 slots"):
            call(*clone(args))


class Calls(TorchDispatchMode):
    """The operators that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.namespace)
        return func(*args, **(kwargs or {}))


def test_unwatched_calls_skip_the_dispatcher():
    # The eager path costs no dispatch (a few microseconds a call, nine calls a layer).
    assert not watched()
    with Calls() as calls:
        for kernel, args in samples():
            kernel(*clone(args))
    assert "rollout" not in calls.names and "aten" in calls.names


def generate(engine, prompts):
    params = SamplingParams(temperature=0.8, max_tokens=6, n=2, seed=3, logprobs=True)
    return [(o.token_ids, o.logprobs) for r in engine.generate(prompts, params)
            for o in r.samples]


def test_the_profiler_names_the_kernels_of_an_engine_step():
    model = tiny_model("llama", seed=0)
    prompts = [[5, 9, 2, 7], [5, 9, 3]]
    engine = Engine(model, EngineConfig(backend="cpu", kv_cache_tokens=256, max_model_len=64))
    plain = generate(engine, prompts)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = generate(engine, prompts)
    assert profiled == plain  # the same kernels, through their operators
    names = {e.key for e in prof.key_averages()}
    expected = {"rollout::paged_attention", "rollout::add_rms_norm", "rollout::rms_norm",
                "rollout::rotary_", "rollout::silu_mul"}
    if linear.supported(torch.device("cpu"), torch.float32):
        expected.add("rollout::linear")
    if gumbel.supported(torch.device("cpu"), torch.float32):
        expected.add("rollout::gumbel_argmax")
    assert expected <= names, sorted(expected - names)


@needs_panels
def test_compile_traces_the_kernels_in_one_graph():
    gen = torch.Generator().manual_seed(2)
    norm_w = torch.randn(24, generator=gen)
    w_gate_up, w_down = torch.randn(64, 24, generator=gen), torch.randn(24, 32, generator=gen)
    gate_up, down = linear.pack_panels(w_gate_up), linear.pack_panels(w_down)

    def mlp_block(x, residual):
        total, h = norm_rope.add_rms_norm(x, residual, norm_w, 1e-6)
        g = linear.linear(h, gate_up, 64)
        return total + linear.linear(silu_mul.silu_mul(g[:, :32], g[:, 32:]), down, 24)

    x, residual = torch.randn(7, 24, generator=gen), torch.randn(7, 24, generator=gen)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(mlp_block, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x, residual), mlp_block(x, residual))
    calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert [c for c in calls if c.startswith("rollout.")] == [
        "rollout.add_rms_norm.default", "rollout.linear.default", "rollout.silu_mul.default",
        "rollout.linear.default"]


def _refusals():
    """Each wrapper handed what its C code would read or write past (another dtype, a weight
    of other in-features, mismatched heads): (call, the start of its ValueError)."""
    bf16 = torch.randn(8, 64).bfloat16()
    x, w = torch.randn(8, 64), torch.ones(64)
    q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 32)
    cos = sin = torch.randn(5, 1, 64)
    packed = (linear.pack_panels(torch.randn(48, 64))
              if linear.supported(torch.device("cpu"), torch.float32) else None)
    rows = paged_attention.NativeRows.of([0, 1], [0, 3], [3, 1], [0, 5], [5, 7],
                                         torch.tensor([0, 1, 2, 12, 13, 3, 4, 5, 6, 7, 8, 14]))
    pool = torch.randn(16, 2, 4)  # a head size of 4 against q's 8
    calls = [(lambda: norm_rope.rms_norm(bf16, w, 1e-6), "rms_norm"),
             (lambda: norm_rope.rms_norm(x, torch.ones(32), 1e-6), "rms_norm"),
             (lambda: norm_rope.add_rms_norm(x, bf16.float()[:4], w, 1e-6), "add_rms_norm"),
             (lambda: norm_rope.rotary_(q.bfloat16(), k.bfloat16(), cos, sin), "rotary_"),
             (lambda: norm_rope.rotary_(q, k, cos, sin), "rotary_"),
             (lambda: silu_mul.silu_mul(bf16, bf16), "silu_mul"),
             (lambda: paged_attention.paged_attention(
                 torch.randn(4, 4, 8), pool, pool, torch.empty(4, 4, 8), rows, 0.35, None, None),
              "paged_attention")]
    if packed is not None:
        calls += [(lambda: linear.linear(torch.randn(3, 96), packed, 48), "linear"),
                  (lambda: linear.linear(bf16, packed, 48), "linear")]
    if gumbel.supported(torch.device("cpu"), torch.float32):
        calls += [(lambda: gumbel.gumbel_argmax(x.double(), torch.zeros(8, dtype=torch.int32)),
                   "gumbel_argmax"),
                  (lambda: gumbel.gumbel_argmax(x, torch.zeros(8, dtype=torch.int64)),
                   "gumbel_argmax")]
    return calls


def test_the_wrappers_refuse_what_the_c_would_overrun():
    """(A bf16 q/k reached rms_norm_f32 under a trainer's autocast: a corrupted heap.)"""
    for call, name in _refusals():
        with pytest.raises(ValueError, match=f"^{name}: "):
            call()


@pytest.mark.parametrize("pack", [False, True])
def test_the_engine_runs_in_its_dtype_under_a_callers_autocast(pack):
    """A trainer may leave torch.autocast on around generate: the engine's forward runs in its
    own dtype regardless, the same tokens and logprobs bit for bit (with the projections in
    F.linear, bf16 activations had reached the fp32 norm kernel)."""
    model = tiny_model("qwen3")

    def run():  # a fresh engine each: a prefix-cache hit would round otherwise
        engine = Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64,
                                            pack_cpu_weights=pack))
        return engine.generate([[1, 2, 3, 4, 5, 6, 7]] * 2,
                               SamplingParams(temperature=0, max_tokens=12, logprobs=True))
    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = run()
    assert [(s.token_ids, s.logprobs) for o in mixed for s in o.samples] == \
        [(s.token_ids, s.logprobs) for o in plain for s in o.samples]


def test_a_graphed_step_runs_outside_a_callers_autocast_too(monkeypatch):
    """CUDA graphs are captured at their first replay: under a caller's autocast they would
    be captured (and replayed ever after) in its dtype. Stand-ins for the graphs and the model
    (graphs need a GPU) record what each branch of the runner runs under."""
    import types

    from rollout.executor import runner

    seen = {}

    class Graphs:
        def run(self, *args):
            seen["graphed"] = torch.is_autocast_enabled("cpu")
            return torch.zeros(1, 4)

    class Model:
        vocab_size = 4

        def __call__(self, ids, ctx):
            seen["eager"] = torch.is_autocast_enabled("cpu")
            return torch.zeros(1, 8)

        def compute_logits(self, hidden):
            return torch.zeros(1, 4)

    run = runner.ModelRunner.__new__(runner.ModelRunner)
    run.graphs, run.model, run.device, run.attention = Graphs(), Model(), torch.device("cpu"), None
    run.forward_seconds = 0.0
    monkeypatch.setattr(runner, "ForwardContext", lambda *args: None)
    ids = torch.zeros(1, dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for graphed in (False, True):
            run.run(types.SimpleNamespace(graphed=graphed, input_ids=ids, positions=ids,
                                          meta=None, logits_index=ids, score=None))
    assert seen == {"eager": False, "graphed": False}
