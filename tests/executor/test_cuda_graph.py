"""Decode steps replayed from graphs (rollout/executor/cuda_graph.py) give the outputs of eager steps.

Off CUDA the graphs are an eager stand-in with the same contract (the captured function sees
only the static buffers and what it closed over at capture), so these tests check the padding
to buckets, the static-buffer plumbing, the fixed launch sizes (max_kv_len = max_model_len)
and the release at sleep; tests/project/test_gpu.py checks real CUDA graphs."""

import pytest
from kernels_env import DEVICE
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.executor import cuda_graph
from rollout.executor.cuda_graph import decode_buckets
from rollout.spec import SpeculativeConfig

pytestmark = pytest.mark.interpreter

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12] * 5]
# Greedy samples, two per prompt, that the sleep, fault and speculative tests all compare to
# one eager run of (the `eager_greedy` fixture): each eager step runs the attention kernels in
# Triton's interpreter, seconds a run.
GREEDY = SamplingParams(n=2, temperature=0, max_tokens=6, logprobs=True)


def engine(graphs: bool, **overrides) -> Engine:
    config = dict(kv_cache_tokens=512, max_model_len=48, max_num_seqs=16,
                  backend="triton", cuda_graphs=graphs)
    config.update(overrides)
    return Engine(tiny_model("qwen3").to(DEVICE), EngineConfig(**config))


def outputs(eng: Engine, params) -> list:
    outs = eng.generate(PROMPTS, params)
    eng.check_invariants()
    return [(s.token_ids, s.logprobs) for o in outs for s in o.samples]


@pytest.fixture(scope="module")
def eager_greedy() -> list:
    return outputs(engine(False), GREEDY)


def assert_same(a, b):
    for (ids_a, lp_a), (ids_b, lp_b) in zip(a, b, strict=True):
        assert ids_a == ids_b
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-4


def test_buckets_cover_every_batch_size():
    for max_batch in (1, 5, 16, 100, 256):
        buckets = decode_buckets(max_batch)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch
        assert all(b >= 1 for b in buckets)


def test_graphed_decode_matches_eager_with_padding_and_finishing_samples():
    # Per-sample max_tokens differ, so the decode batch shrinks step by step through
    # several buckets (7 -> 6 -> 5 -> 4 -> 2 -> 1 rows, padded to 8, 8, 8, 4, 2, 1).
    params = [SamplingParams(n=n, temperature=0.8, max_tokens=m, logprobs=True, seed=s,
                             ignore_eos=True)
              for n, m, s in ((3, 6, 1), (2, 3, 2), (2, 8, 3))]
    eager, graphed = engine(False), engine(True)
    graphs = graphed.stack.graphs
    run, storages = graphs.run, set()

    def recorded(*args):
        logits = run(*args)
        storages.add(logits.untyped_storage().data_ptr())
        return logits

    graphs.run = recorded
    assert_same(outputs(eager, params), outputs(graphed, params))
    # Every decode step of the longest samples (max_tokens 8) replays a graph.
    assert graphs.replays >= 7 and len(graphs.graphs) >= 3
    assert set(graphs.graphs) <= set(graphs.buckets)
    # Every bucket's graph writes into the one shared logits buffer.
    assert storages == {graphs.static.logits.untyped_storage().data_ptr()}


def test_graphs_are_dropped_at_sleep_and_captured_again(eager_greedy):
    eng = engine(True)
    first = outputs(eng, GREEDY)
    assert_same(eager_greedy, first)
    captured = set(eng.stack.graphs.graphs)
    assert captured and eng.stats.graph_captures == len(captured)
    assert eng.stats.graph_capture_seconds > 0
    # Awake, the graphs stay: a decode step of the same batch captures nothing again.
    outputs(eng, SamplingParams(n=2, temperature=0, max_tokens=2))
    assert eng.stats.graph_captures == len(captured)
    eng.sleep(1)
    assert not eng.stack.graphs.graphs and eng.stack.graphs.static is None
    eng.wake_up()
    assert_same(first, outputs(eng, GREEDY))
    assert set(eng.stack.graphs.graphs) == captured  # the same steps use the same buckets
    assert eng.stats.graph_captures == 2 * len(captured)


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
def test_a_fault_while_capturing_leaves_the_engine_exact_and_nothing_counted(fault, monkeypatch,
                                                                            eager_greedy):
    """A capture that raises (an error, or Ctrl-C: interrupts may land in a step's forward):
    the step is undone, no graph is kept and none counted; the next call captures and gives
    the eager outputs."""
    eng = engine(True)

    def failing(self, forward, pool):
        raise fault("injected while capturing")

    monkeypatch.setattr(cuda_graph._EagerGraph, "__init__", failing)
    with pytest.raises(fault):
        eng.generate(PROMPTS, GREEDY)
    eng.check_invariants()
    assert not eng.stack.graphs.graphs
    assert eng.stats.graph_captures == 0 and eng.stats.graph_capture_seconds == 0
    monkeypatch.undo()
    assert_same(eager_greedy, outputs(eng, GREEDY))
    assert eng.stats.graph_captures == len(eng.stack.graphs.graphs) > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_verify_steps_run_eagerly_beside_graphed_decodes(method, eager_greedy):
    # With a draft model, the draft's own decode steps replay its graphs too.
    draft = tiny_model("qwen3", seed=1).to(DEVICE) if method == "draft" else None
    spec = SpeculativeConfig(method, num_speculative_tokens=3, draft_model=draft)
    graphed = engine(True, speculative=spec)
    assert_same(eager_greedy, outputs(graphed, GREEDY))
    assert graphed.stats.spec_verifications > 0
    if method == "draft":
        assert graphed.speculator.drafter.stack.graphs.replays > 0


def test_cuda_graphs_need_the_triton_backend():
    with pytest.raises(ValueError, match="cuda_graphs: needs the Triton attention backend"):
        engine(True, backend="torch")


def test_graphed_decode_with_split_kv():
    # max_model_len 600: graphed steps launch attention with max_kv_len = 600, which splits the
    # context (split-KV, most splits empty for these short rows) where eager steps do not.
    params = SamplingParams(n=1, temperature=0.8, max_tokens=4, logprobs=True, seed=1,
                            ignore_eos=True)
    sizes = dict(kv_cache_tokens=600, max_model_len=600)
    graphed = engine(True, **sizes)
    assert_same(outputs(engine(False, **sizes), params), outputs(graphed, params))
    assert graphed.stack.graphs.replays > 0


def test_graphed_decode_under_preemption_with_an_odd_max_num_seqs():
    # A pool of 36 slots preempts (3 preemptions; the 11 samples need 80); max_num_seqs 11 is
    # not a bucket of the small series, and the 11 samples fill it before the pool runs out.
    params = [SamplingParams(n=n, temperature=0.8, max_tokens=m, logprobs=True, seed=s,
                             ignore_eos=True) for n, m, s in ((4, 6, 1), (4, 4, 2), (3, 8, 3))]
    sizes = dict(kv_cache_tokens=36, max_model_len=32, max_num_seqs=11)
    graphed = engine(True, **sizes)
    assert_same(outputs(engine(False, **sizes), params), outputs(graphed, params))
    graphs = graphed.stack.graphs
    assert graphed.stats.preemptions > 0 and graphs.replays > 0
    assert 11 in graphs.graphs and set(graphs.graphs) <= set(graphs.buckets)
