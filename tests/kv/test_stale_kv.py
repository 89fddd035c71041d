"""K/V kept across weight updates (KVManager.keep_stale, EngineConfig(carried_kv="park")): the
prefix cache shares K/V of alike tokens exactly where every position of it came from the same
weights (Sequence.kv_tag, Sequence.kv_bounds), across several updates.

Reference: when a position's K/V is computed, its K gets a code of the tokens so far and of the
weights each of their positions was computed under; a sequence must read back its own codes,
and two positions share a slot exactly when their codes are equal.
"""

from __future__ import annotations

import pytest
import torch

from rollout.journal import Journal
from rollout.kv.manager import KVManager
from rollout.kv.pool import KVPool
from rollout.kv.radix_cache import RadixCache
from rollout.kv.slot_table import SlotTable
from rollout.requests.sequence import Sequence
from rollout.sample.params import SamplingParams

CPU = torch.device("cpu")
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # every sample's: greedy samples alike


class Stale:
    def __init__(self) -> None:
        pool = KVPool(num_layers=1, num_slots=128, kv_heads=1, head_dim=1,
                      dtype=torch.float32, device=CPU)
        self.kv = KVManager(pool, RadixCache(CPU), SlotTable(4, 32, CPU), Journal())
        self.weights = 0
        self.codes: dict[tuple, float] = {}
        self.history: dict[int, list[int]] = {}  # seq_id -> weights of each computed position

    def seq(self, seq_id: int) -> Sequence:
        return Sequence(seq_id=seq_id, group=str(seq_id), sample_index=0, prompt_ids=TOKENS[:4],
                        params=SamplingParams(), seed=0, stop_ids=frozenset())

    def own(self, seq: Sequence, end: int) -> list[float]:
        """The codes of what `seq` computed at positions < end."""
        history = self.history[seq.seq_id]
        return [self.codes.setdefault((tuple(TOKENS[:i + 1]), tuple(history[:i + 1])),
                                      float(len(self.codes) + 1)) for i in range(end)]

    def read(self, slots: torch.Tensor) -> list[float]:
        return self.kv.pool.buffer[0, 0, slots, 0, 0].tolist()

    def admit(self, seq: Sequence) -> int:
        slots, node = self.kv.match(seq.reusable_tokens())
        self.kv.lock(node)
        self.kv.attach(seq, slots, node)
        return slots.numel()

    def compute(self, seq: Sequence, end: int) -> int:
        """Admit `seq`, decode it until its positions up to `end` are computed under the
        weights now, and retract it (its K/V to the tree); returns how many positions
        admission matched."""
        kv = self.kv
        matched = self.admit(seq)
        seq.token_ids = list(TOKENS[:end + 1])
        history = self.history.setdefault(seq.seq_id, [])
        # Positions it never computed (matched from another's K/V) must be what it would
        # compute now.
        history += [self.weights] * (matched - len(history))
        assert self.read(kv.table.read(seq.row, 0, matched)) == self.own(seq, matched)
        history[matched:] = [self.weights] * (end - matched)
        slots = kv.alloc(end - matched)
        kv.place(seq, matched, slots)
        kv.pool.buffer[0, 0, slots, 0, 0] = torch.tensor(self.own(seq, end)[matched:])
        kv.advance(seq, end - matched)
        kv.settle()
        kv.release(seq)
        kv.check()
        assert self.read(kv.cache.peek(seq.cache_key(end))) == self.own(seq, end)
        return matched

    def update(self, seqs: list[Sequence]) -> None:
        self.kv.keep_stale(seqs)
        self.weights += 1
        self.kv.check()


def test_alike_tokens_share_kv_exactly_where_their_weights_agree():
    """Three greedy samples, A one token ahead of B and C at the first update, B one ahead of C
    at the second: each reads back its own K/V, and the tree holds one slot per distinct
    (tokens, weights of each position) of them, not one per tokens (where B's had been A's)."""
    w = Stale()
    a, b, c = (w.seq(i) for i in range(3))
    assert [w.compute(a, 7), w.compute(b, 6), w.compute(c, 6)] == [0, 3, 3]
    w.update([a, b, c])
    assert [w.compute(a, 9), w.compute(b, 8), w.compute(c, 8)] == [7, 6, 6]
    w.update([a, b, c])
    assert [w.compute(a, 11), w.compute(b, 10), w.compute(c, 9)] == [9, 8, 8]
    assert {s.kv_tag for s in (a, b, c)} == {1}
    assert (a.kv_bounds, b.kv_bounds, c.kv_bounds) == (((7, 2), (9, 3)), ((6, 2), (8, 3)),
                                                       ((6, 2), (8, 3)))
    ends = {a: 11, b: 10, c: 9}
    slots = {s: w.kv.cache.peek(s.reusable_tokens()).tolist() for s in ends}
    codes = {}
    for s, end in ends.items():
        assert len(slots[s]) == end
        codes.update(zip(slots[s], w.own(s, end)))
    assert len(set(codes.values())) == len(codes)  # one slot per distinct K/V
    assert slots[b][:9] == slots[c][:9]  # identical histories share


def test_a_sample_that_lost_its_stale_kv_is_fresh_again():
    """A tagged sample whose cached K/V is all gone (evicted) computes its whole context under
    the current weights: it drops its tag and shares with a fresh request's alike tokens."""
    w = Stale()
    a = w.seq(0)
    w.compute(a, 7)
    w.update([a])
    assert a.kv_tag == 1
    w.kv.alloc(w.kv.num_slots)  # evicts everything
    w.kv.discard_pending()
    assert w.compute(a, 8) == 0 and (a.kv_tag, a.kv_bounds) == (None, ())
    assert w.compute(w.seq(1), 8) == 3  # its prompt but the newest token


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
def test_an_admission_undone_leaves_the_labels_as_they_were(kind):
    """A unit that admits a tagged sample (labelling its new positions) and fails leaves the
    sample's tag and labels, and everything else, as before; admitting it again labels it
    alike."""
    w = Stale()
    a, b = w.seq(0), w.seq(1)
    w.compute(a, 7)
    w.compute(b, 6)
    w.update([a, b])
    before = (b.kv_tag, b.kv_bounds, b.num_computed, b.row, b.node)
    with pytest.raises(kind), w.kv.journal.unit():
        w.admit(b)
        assert b.kv_bounds == ((6, 2),)
        raise kind("injected fault")
    assert (b.kv_tag, b.kv_bounds, b.num_computed, b.row, b.node) == before
    w.kv.check()
    assert w.compute(b, 8) == 6 and b.kv_bounds == ((6, 2),)
    assert w.compute(a, 9) == 7


def test_siblings_read_one_prompt_kv_only_where_its_weights_agree():
    """The attention's shared-prompt split (executor/runner.py) reads a group's prompt once for
    the samples whose prompt_kv is equal: a tagged prompt whose end was computed again under
    later weights (evicted, then re-admitted after another update) is its sample's own."""
    w = Stale()
    fresh, kept, relabelled, later = (w.seq(i) for i in range(4))
    kept.kv_tag = relabelled.kv_tag = later.kv_tag = 1
    relabelled.kv_bounds = ((2, 2), (6, 3))  # prompt positions 2.. under the next weights
    later.kv_bounds = ((6, 3),)  # past its 4-token prompt: the prompt as kept's
    assert fresh.prompt_kv is None
    assert kept.prompt_kv == later.prompt_kv == (1,)
    assert relabelled.prompt_kv == (1, (2, 2))
