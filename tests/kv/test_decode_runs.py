"""Decoding sequences take consecutive KV slots (KVManager.alloc_decodes, KVPool.arrange_runs):
the free list is ordered so that each of a batch's decoding sequences gets a run of
consecutive slots, so attention reads a sample's own tokens as runs rather than one slot in
every batch-size, and goes on after its newest slot when the batch changes. Only the free
list's order changes: the rollback of every arrangement is covered by
tests/kv/test_kv_manager.py's random transactions (free-stack order compared exactly) and
here."""

import pytest
import torch
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.kv.manager import DECODE_RUN
from rollout.kv.pool import KVPool


def pool_of(slots: int) -> KVPool:
    return KVPool(1, slots, 1, 8, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("streams, run", [(1, 4), (5, 3), (16, 32)])
def test_arranged_allocations_give_each_stream_a_run(streams, run):
    pool = pool_of(streams * run + 7)
    before = sorted(pool.free_slots().tolist())
    pool.arrange_runs(streams, run)
    assert sorted(pool.free_slots().tolist()) == before  # the same free slots, reordered
    taken = torch.stack([pool.alloc(streams) for _ in range(run)], dim=1)  # [streams, run]
    assert (taken[:, 1:] - taken[:, :-1] == 1).all()
    assert sorted(taken.flatten().tolist()) == before[-streams * run:]


def test_runs_follow_the_free_slots_and_the_order_comes_back():
    pool = pool_of(40)
    pool.alloc(40)  # nothing free but what is freed next
    scattered = torch.tensor([3, 30, 4, 31, 5, 32, 20, 21, 22, 23, 1, 2])
    pool.free(scattered)
    old = pool.arrange_runs(3, 4)
    runs = torch.stack([pool.alloc(3) for _ in range(4)], dim=1)
    assert runs.tolist() == [[1, 2, 3, 4], [5, 20, 21, 22], [23, 30, 31, 32]]  # sorted, cut
    for slots in reversed(runs.t()):
        pool.free(slots)
    pool.restore_order(old)
    assert torch.equal(pool.free_slots(), scattered)


def test_streams_go_on_after_their_newest_slot_where_it_is_free():
    """Stream 0's newest slot 10 is followed by free 11-12 (13 is in use), stream 1's 20 by free
    21-24, stream 2's 30 by nothing free, stream 3 shares stream 1's newest slot (samples with
    equal tokens on one cached path): it must not go on into the same slots. The missing slots
    come sorted from the top of the rest; the free set is unchanged and the order comes back."""
    pool = pool_of(64)
    pool.alloc(64)
    free = torch.tensor([50, 11, 40, 22, 12, 41, 21, 42, 23, 43, 24, 44, 45, 46, 47, 48, 49,
                         51, 52, 53])
    pool.free(free)
    old = pool.arrange_runs(4, 3, torch.tensor([10, 20, 30, 20]))
    assert sorted(pool.free_slots().tolist()) == sorted(free.tolist())
    runs = torch.stack([pool.alloc(4) for _ in range(3)], dim=1).tolist()
    # 7 slots missing (1 + 0 + 3 + 3): the top 7 of the rest, sorted, stream by stream
    assert runs == [[11, 12, 46], [21, 22, 23], [47, 48, 49], [51, 52, 53]]
    assert pool.free_slots().tolist() == [50, 40, 41, 42, 43, 24, 44, 45]
    for slots in reversed(torch.tensor(runs).t()):
        pool.free(slots)
    pool.restore_order(old)
    assert torch.equal(pool.free_slots(), free)


def test_samples_keep_their_runs_while_others_end():
    """Requests ending every 3 steps (EOS-like: the batch changes all along): the longest
    samples' own tokens still lie in consecutive slots, a break at most every DECODE_RUN
    tokens and where a run met a slot in use; re-arranged from the free list's top alone they
    broke at every change of the batch."""
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=4096, max_model_len=128,
                                                       max_num_seqs=32))
    for i in range(8):
        engine.add_request([1 + i, 2, 3, 4, 5], SamplingParams(n=4, max_tokens=16 + 3 * i,
                                                                ignore_eos=True, seed=i))
    gaps = []
    while engine.has_unfinished:
        engine.step()
        for seq in engine.scheduler.running:
            if seq.num_computed - seq.num_prompt == 34:  # the last request: 37 tokens own
                own = engine.kv.table.read(seq.row, seq.num_prompt + 1, seq.num_computed)
                gaps.append(int((own[1:] - own[:-1] != 1).sum()))
    assert len(gaps) == 4 and max(gaps) <= 4, gaps


def test_an_engines_decoding_samples_read_their_tokens_in_runs():
    """16 samples of 2 prompts decode 40 tokens: beyond the first few (decided while the batch
    was still forming), each sample's own tokens lie in consecutive slots, a break at most
    every DECODE_RUN tokens."""
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=2048, max_model_len=128,
                                                       max_num_seqs=16))
    params = SamplingParams(n=8, max_tokens=40, ignore_eos=True, seed=3)
    for prompt in ([1, 2, 3, 4, 5], [6, 7, 8, 9]):
        engine.add_request(prompt, params)
    gaps = []
    while engine.has_unfinished:
        engine.step()
        for seq in engine.scheduler.running:
            if seq.num_computed - seq.num_prompt == 36:
                own = engine.kv.table.read(seq.row, seq.num_prompt + 2, seq.num_computed)
                gaps.append(int((own[1:] - own[:-1] != 1).sum()))
    # 34 tokens: at most two run boundaries and one change of the batch (left alone, every
    # neighbour would be 16 slots away: 33 breaks)
    assert DECODE_RUN >= 16
    assert len(gaps) == 16 and max(gaps) <= 3, gaps
