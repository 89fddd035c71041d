"""KVManager transactions against an independent reference, on CPU.

A random driver performs what the engine performs (admit after match + lock, grow, scratch
allocations that evict, a "forward" that writes K/V, commit: advance / free rejected slots /
append a token / cache_computed / release(keep_kv), truncate, settle), always legally. Each
block of operations runs either outside a unit (final: it builds varied states) or inside
`journal.unit()`, where it sometimes completes and sometimes is broken by an error or a
KeyboardInterrupt raised at a random point: between two operations, or inside one, right after
its n-th journal record or touch.

Three things are checked, each independent of `KVManager.check()`:
- `Ref`: a token-level model of every slot's owner (free set, prefix -> slot, each sequence's
  computed slots, pending), updated from the driver's own operations; evictions are learned
  from the slots that come back and checked to be legal. Compared after every operation.
- K/V contents: the "forward" writes a code of the token prefix into each new slot's K, so a
  cached prefix or a computed position whose slot holds another prefix's K/V is caught.
- After a broken unit: a canonical snapshot of all observable bookkeeping equals the one taken
  when the unit began, exactly (free-stack order and free table rows included).
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from rollout.journal import Journal, RollbackFailed
from rollout.kv.manager import KVManager
from rollout.kv.pool import KVPool
from rollout.kv.prefix_cache import make_prefix_cache
from rollout.kv.slot_table import SlotTable
from rollout.requests.sequence import Sequence
from rollout.sample.params import SamplingParams

CPU = torch.device("cpu")
NUM_SLOTS = 96
MAX_SEQS = 8
MAX_LEN = 48
ALPHABET = 4  # tiny: prompts share prefixes and diverge inside edges all the time
SEEDS = range(5)
STEPS = 40
SCRATCH_CODE = -1.0  # what the forward writes into a scratch allocation's slots


class InjectedFault(Exception):
    """The error the test raises inside a unit."""


class FaultyJournal(Journal):
    """A Journal that can raise right after its n-th `record`/`touch` inside a unit: where an
    error inside a KV operation would interrupt it, with everything so far logged."""

    def __init__(self) -> None:
        super().__init__()
        self._countdown: int | None = None
        self._fault: BaseException | None = None

    def arm(self, n: int, fault: BaseException) -> None:
        self._countdown, self._fault = n, fault

    def disarm(self) -> bool:
        """True when the armed fault had not fired."""
        armed, self._countdown = self._countdown is not None, None
        return armed

    def _tick(self) -> None:
        if self._countdown is not None and self.recording:
            self._countdown -= 1
            if self._countdown == 0:
                self._countdown = None
                raise self._fault

    def record(self, undo) -> None:
        super().record(undo)
        self._tick()

    def touch(self, seq) -> None:
        super().touch(seq)
        self._tick()


# --- the reference --------------------------------------------------------------------------
@dataclass
class RefSeq:
    slots: list[int]  # slot of each computed position
    cached_len: int


@dataclass
class Ref:
    """Who owns each slot, token by token; knows nothing of edges, nodes or the journal."""
    free: set[int]
    tree: dict[tuple[int, ...], int] = field(default_factory=dict)  # cached prefix -> slot
    seqs: dict[int, RefSeq] = field(default_factory=dict)
    pending: list[list[int]] = field(default_factory=list)
    hits: int = 0


@dataclass(frozen=True)
class Item:
    """One scheduled piece of a step: positions start.. of `seq` in `slots`; seq None is a
    scratch allocation (made to force evictions) handed back at commit."""
    seq: Sequence | None
    start: int
    slots: tuple[int, ...]


# --- inspection helpers (read the real structures naively) ----------------------------------
def node_path(cache, node) -> tuple | None:
    """Tokens from the root to the end of `node`; ("detached",) if it is not in the tree."""
    if node is None:
        return None
    keys = []
    while node is not cache.root:
        parent = node.parent
        if parent is None or parent.children.get(node.key[0]) is not node:
            return ("detached",)
        keys.append(node.key)
        node = parent
    return tuple(t for key in reversed(keys) for t in key)


def tree_map(cache) -> dict[tuple[int, ...], tuple[int, int]]:
    """Every cached prefix -> (slot of its last token, lock count): independent of edge
    splits."""
    out = {}
    stack = [(child, ()) for child in cache.root.children.values()] if cache.shares_prefixes \
        else []
    while stack:
        node, base = stack.pop()
        for i, slot in enumerate(node.value.tolist()):
            out[base + tuple(node.key[:i + 1])] = (slot, node.lock_ref)
        path = base + tuple(node.key)
        stack.extend((child, path) for child in node.children.values())
    return out


def naive_slot_owners(kv: KVManager) -> None:
    """Recomputed from scratch: each slot is in exactly one of free / tree / one sequence's
    private tail / pending."""
    owners: dict[int, list[str]] = {s: [] for s in range(kv.pool.num_slots)}

    def own(slots, where):
        for s in slots:
            assert s in owners, f"slot {s} out of range ({where})"
            owners[s].append(where)

    own(kv.pool.free_slots().tolist(), "free")
    for node in kv.cache.nodes():
        own(node.value.tolist(), "tree")
    for seq in kv.attached.values():
        own(kv.table.read(seq.row, seq.cached_len, seq.num_computed).tolist(),
            f"seq {seq.seq_id}")
    for slots in kv.pending:
        own(slots.tolist(), "pending")
    bad = {s: where for s, where in owners.items() if len(where) != 1}
    assert not bad, f"slots not in exactly one place: {bad}"


# --- the world and its driver ---------------------------------------------------------------
class World:
    def __init__(self, enabled: bool, seed: int = 0, num_slots: int = NUM_SLOTS) -> None:
        self.enabled = enabled
        self.rng = random.Random(seed)
        self.pool = KVPool(num_layers=1, num_slots=num_slots, kv_heads=1, head_dim=1,
                           dtype=torch.float32, device=CPU)
        self.table = SlotTable(MAX_SEQS, MAX_LEN, CPU)
        self.cache = make_prefix_cache(enabled, CPU)
        self.journal = FaultyJournal()
        self.kv = KVManager(self.pool, self.cache, self.table, self.journal)
        self.ref = Ref(free=set(range(num_slots)))
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.items: list[Item] = []
        self.codes: dict[tuple[float, int], float] = {}
        self.next_id = 0
        self.pin: tuple[int, ...] | None = None  # admission lock between lock and attach
        self.in_unit = False
        self.unit_evicted = self.unit_inserted = 0
        self.between: BaseException | None = None  # fault to raise between operations
        self.stats: Counter = Counter()

    # --- reference helpers ------------------------------------------------------------------
    def _code(self, parent: float, token: int) -> float:
        return self.codes.setdefault((parent, token), float(len(self.codes) + 1))

    def codes_of(self, tokens, n: int) -> list[float]:
        """The K value a forward writes for position i < n: one code per token prefix."""
        out, c = [], 0.0
        for t in tokens[:n]:
            c = self._code(c, t)
            out.append(c)
        return out

    def pins(self) -> Counter:
        pins: Counter = Counter()
        for seq in self.running:
            for i in range(self.ref.seqs[seq.seq_id].cached_len):
                pins[tuple(seq.token_ids[:i + 1])] += 1
        if self.pin is not None:
            for i in range(len(self.pin)):
                pins[self.pin[:i + 1]] += 1
        return pins

    def unlocked(self) -> set[tuple[int, ...]]:
        pins = self.pins()
        return {p for p in self.ref.tree if pins[p] == 0}

    def assert_ref(self) -> None:
        """The real bookkeeping equals the reference's, and the K/V contents fit the tokens."""
        kv, ref = self.kv, self.ref
        free = kv.pool.free_slots().tolist()
        assert len(free) == len(set(free)) == kv.pool.num_free, "free stack holds duplicates"
        assert set(free) == ref.free, (sorted(set(free) ^ ref.free), "free set differs")
        real = tree_map(self.cache)
        assert {p: s for p, (s, _) in real.items()} == ref.tree, "cached prefixes differ"
        pins = self.pins()
        locks = {p: lock for p, (_, lock) in real.items()}
        assert locks == {p: pins[p] for p in ref.tree}, "lock counts differ from the pins"
        unlocked = sum(1 for p in ref.tree if pins[p] == 0)
        assert (self.cache.evictable_size, self.cache.protected_size) == \
            (unlocked, len(ref.tree) - unlocked)
        assert kv.available == len(ref.free) + unlocked
        assert sorted(kv.attached) == sorted(ref.seqs) == sorted(s.seq_id for s in self.running)
        k = self.pool.k(0)[:, 0, 0]
        for seq in self.running:
            r = ref.seqs[seq.seq_id]
            assert kv.attached[seq.seq_id] is seq
            assert (seq.num_computed, seq.cached_len) == (len(r.slots), r.cached_len)
            assert kv.table.read(seq.row, 0, seq.num_computed).tolist() == r.slots
            assert seq.num_computed <= seq.num_tokens
            assert k[r.slots].tolist() == self.codes_of(seq.token_ids, len(r.slots)), \
                f"seq {seq.seq_id}: a computed position's K/V is not its tokens'"
        for seq in self.waiting:
            assert (seq.row, seq.num_computed, seq.cached_len, seq.node) == (-1, 0, 0, None)
        if ref.tree:
            prefixes = sorted(ref.tree, key=len)
            assert all(p[:-1] in ref.tree for p in prefixes if len(p) > 1), "tree not closed"
            code = {(): 0.0}
            for p in prefixes:
                code[p] = self._code(code[p[:-1]], p[-1])
            got = k[[ref.tree[p] for p in prefixes]].tolist()
            assert got == [code[p] for p in prefixes], "a cached prefix holds other K/V"
        assert [p.tolist() for p in kv.pending] == ref.pending
        assert kv.cache_hit_tokens == ref.hits

    def full_check(self) -> None:
        """At a unit boundary: the manager's own check, the naive one, the reference."""
        self.kv.check()
        naive_slot_owners(self.kv)
        self.assert_ref()

    def canonical(self) -> dict:
        """Everything observable about the KV bookkeeping, independent of edge splits."""
        kv = self.kv
        seqs = {}
        for seq in self.running + self.waiting:
            row = (tuple(kv.table.read(seq.row, 0, seq.num_computed).tolist())
                   if seq.row >= 0 else None)
            seqs[seq.seq_id] = (seq.row, seq.num_computed, seq.cached_len,
                                node_path(self.cache, seq.node), tuple(seq.token_ids),
                                tuple(seq.logprobs), row)
        return dict(
            free=kv.pool.free_slots().tolist(), num_free=kv.pool.num_free,
            tree=tree_map(self.cache), evictable=self.cache.evictable_size,
            protected=self.cache.protected_size,
            free_rows=list(kv.table.free_rows), num_free_rows=kv.table.num_free_rows,
            attached=sorted(kv.attached), seqs=seqs,
            pending=[p.tolist() for p in kv.pending], hits=kv.cache_hit_tokens)

    # --- operations (each: the real one, then the reference's) --------------------------------
    def _done(self) -> None:
        self.stats["ops"] += 1
        if self.in_unit:
            self.stats["ops_in_units"] += 1
        self.assert_ref()

    def boundary(self) -> None:
        """Between two operations: maybe the injected fault."""
        if self.between is not None and self.rng.random() < 0.25:
            fault, self.between = self.between, None
            self.stats["faults_between"] += 1
            raise fault

    def new_seq(self, tokens: list[int]) -> Sequence:
        seq = Sequence(seq_id=self.next_id, group="g", sample_index=0, prompt_ids=list(tokens),
                       params=SamplingParams(), seed=0, stop_ids=frozenset())
        self.next_id += 1
        self.waiting.append(seq)
        return seq

    def match(self, tokens: list[int]):
        n = 0
        while n < len(tokens) and tuple(tokens[:n + 1]) in self.ref.tree:
            n += 1
        nodes = sum(1 for _ in self.cache.nodes())
        slots, node = self.kv.match(tokens)
        if sum(1 for _ in self.cache.nodes()) > nodes:
            self.stats["splits"] += 1
        assert slots.tolist() == [self.ref.tree[tuple(tokens[:i + 1])] for i in range(n)]
        assert node_path(self.cache, node) == tuple(tokens[:n])
        return slots, node

    def _take_evicted(self, back: set[int], short: int) -> None:
        """Slots that came back beyond the reference's free ones were evicted: they must be
        unlocked cached prefixes, whole subtrees, and at least `short` of them."""
        evicted = back - self.ref.free
        by_slot = {s: p for p, s in self.ref.tree.items()}
        assert evicted <= set(by_slot), "a slot came back that was neither free nor cached"
        gone = {by_slot[s] for s in evicted}
        assert gone <= self.unlocked(), "a locked prefix was evicted"
        assert all(p[:-1] not in gone for p in self.ref.tree if p not in gone), \
            "an eviction left a prefix without its parent"
        if short <= 0:
            assert not gone, "evicted while enough slots were free"
        for p in gone:
            del self.ref.tree[p]
        self.stats["evicted"] += len(gone)
        self.unit_evicted += len(gone)

    def alloc(self, n: int, decodes: bool = False) -> tuple[int, ...] | None:
        """kv.alloc(n), or kv.alloc_decodes(n) (one slot for each of n decoding sequences)."""
        short = n - len(self.ref.free)
        available = len(self.ref.free) + len(self.unlocked())
        slots = self.kv.alloc_decodes(n) if decodes else self.kv.alloc(n)
        now = self.pool.free_slots().tolist()
        got = [] if slots is None else slots.tolist()
        back = set(now) | set(got)
        assert len(back) == len(now) + len(got), "allocated slots are still free"
        assert self.ref.free <= back, "free slots vanished"
        untouched = back == self.ref.free
        self._take_evicted(back, short)
        if slots is None:
            assert n > available, "alloc failed with room to evict"
            # Inside a unit a failed alloc takes nothing back (the caller preempts and asks
            # again); outside one its evictions stand.
            assert untouched if self.in_unit else not self.unlocked(), \
                "a failed alloc left the wrong evictions"
        else:
            assert len(got) == n and n <= available
            self.ref.pending.append(got)
        self.ref.free = set(now)
        self._done()
        return None if slots is None else tuple(got)

    def clear_cache(self) -> None:
        unlocked = {self.ref.tree[p] for p in self.unlocked()}
        self.kv.clear_cache()
        back = set(self.pool.free_slots().tolist())
        assert back - self.ref.free == unlocked, "clear_cache must evict exactly the unlocked"
        self._take_evicted(back, len(unlocked))
        self.ref.free = back
        self._done()

    def free(self, slots) -> None:
        self.kv.free(torch.tensor(slots, dtype=torch.int64))
        self.ref.free |= set(slots)
        self._done()

    def admit(self, seq: Sequence) -> bool:
        """As the scheduler admits: match all but the last token, lock, allocate the rest if
        there is room (else unlock), attach, place."""
        if self.table.num_free_rows == 0:
            return False
        tokens = seq.token_ids[:-1]
        slots, node = self.match(tokens)
        matched = slots.numel()
        self.kv.lock(node)
        self.pin = tuple(tokens[:matched])
        self._done()
        n = seq.num_tokens - matched
        if self.kv.available < n:
            self.kv.unlock(node)
            self.pin = None
            self._done()
            return False
        new = self.alloc(n)
        assert new is not None
        self.kv.attach(seq, slots, node)
        self.pin = None
        self.ref.seqs[seq.seq_id] = RefSeq(slots.tolist(), matched)
        self.ref.hits += matched
        self.waiting.remove(seq)
        self.running.append(seq)
        self._done()
        self.kv.place(seq, seq.num_computed, torch.tensor(new, dtype=torch.int64))
        self.items.append(Item(seq, matched, new))
        self._done()
        self.stats["admitted"] += 1
        return True

    def grow(self, seq: Sequence, n: int) -> bool:
        """Slots for the next n positions of a running sequence."""
        slots = self.alloc(n)
        if slots is None:
            return False
        self.kv.place(seq, seq.num_computed, torch.tensor(slots, dtype=torch.int64))
        self.items.append(Item(seq, seq.num_computed, slots))
        self._done()
        return True

    def grow_decodes(self, seqs: list[Sequence]) -> bool:
        """One slot for the next position of each of `seqs`, in one allocation (the
        scheduler's decode growth, whose free list is arranged into per-sequence runs)."""
        slots = self.alloc(len(seqs), decodes=True)
        if slots is None:
            return False
        self.kv.place_decodes(seqs, torch.tensor(slots, dtype=torch.int64))
        self.items.extend(Item(seq, seq.num_computed, (slot,)) for seq, slot in zip(seqs, slots))
        self._done()
        return True

    def scratch(self, n: int) -> None:
        slots = self.alloc(n)
        if slots is not None:
            self.items.append(Item(None, -1, slots))

    def forward(self) -> None:
        """Writes each scheduled position's K/V (never inside a unit, as in the engine)."""
        assert not self.journal.recording
        k = self.pool.k(0)[:, 0, 0]
        for it in self.items:
            if it.seq is None:
                k[list(it.slots)] = SCRATCH_CODE
            else:
                codes = self.codes_of(it.seq.token_ids, it.start + len(it.slots))
                k[list(it.slots)] = torch.tensor(codes[it.start:])

    def advance(self, seq: Sequence, n: int, slots) -> None:
        self.kv.advance(seq, n)
        self.ref.seqs[seq.seq_id].slots.extend(slots)
        self._done()

    def append(self, seq: Sequence, tokens: list[int]) -> None:
        self.journal.touch(seq)
        seq.token_ids.extend(tokens)
        seq.logprobs.extend(-0.5 for _ in tokens)
        self._done()

    def cache_computed(self, seq: Sequence) -> None:
        self.kv.cache_computed(seq)
        self._ref_cache(seq)
        self._done()

    def _ref_cache(self, seq: Sequence) -> None:
        r = self.ref.seqs[seq.seq_id]
        if not self.enabled:
            r.cached_len = 0
            return
        for i in range(len(r.slots)):
            prefix = tuple(seq.token_ids[:i + 1])
            if prefix in self.ref.tree:
                if i >= r.cached_len:  # a private duplicate: freed, the tree's copy used
                    self.ref.free.add(r.slots[i])
                    r.slots[i] = self.ref.tree[prefix]
            else:
                self.ref.tree[prefix] = r.slots[i]
                self.unit_inserted += 1
        r.cached_len = len(r.slots)

    def truncate(self, seq: Sequence, num_computed: int) -> None:
        self.kv.truncate(seq, num_computed)
        r = self.ref.seqs[seq.seq_id]
        keep = max(num_computed, r.cached_len)
        self.ref.free |= set(r.slots[keep:])
        del r.slots[keep:]
        self._done()

    def release(self, seq: Sequence, keep_kv: bool, requeue: bool) -> None:
        """Finish (requeue False) or preempt (True) a running sequence."""
        self.kv.release(seq, keep_kv)
        if keep_kv:
            self._ref_cache(seq)
        r = self.ref.seqs.pop(seq.seq_id)
        self.ref.free |= set(r.slots[r.cached_len:])
        self.running.remove(seq)
        if requeue:
            self.waiting.insert(0, seq)
        self._done()

    def settle(self) -> None:
        self.kv.settle()
        self.ref.pending = []
        self.items = []
        self._done()

    def discard_pending(self) -> None:
        """After a failed step (outside any unit): exactly the pending slots go back."""
        pending = [s for p in self.ref.pending for s in p]
        before = self.pool.free_slots().tolist()
        self.kv.discard_pending()
        after = self.pool.free_slots().tolist()
        assert sorted(after) == sorted(before + pending), "discard_pending freed other slots"
        self.ref.free |= set(pending)
        self.ref.pending = []
        self.items = []
        self._done()
        self.stats["discarded"] += 1

    # --- transactions -----------------------------------------------------------------------
    def _save(self):
        return (copy.deepcopy(self.ref), list(self.running), list(self.waiting),
                list(self.items), self.pin)

    def _restore(self, saved) -> None:
        self.ref, self.running, self.waiting, self.items, self.pin = saved

    def in_a_unit(self, body, mode: str, fault: BaseException | None = None) -> bool:
        """Run `body` in a unit. mode: "complete"; "record" (raise after the n-th journal
        record/touch), "between" (raise between two operations), "end" (raise after the last
        one). A broken unit must leave the bookkeeping exactly as it began. True: committed."""
        fault = fault or InjectedFault("injected")
        snapshot, saved = self.canonical(), self._save()
        self.in_unit = True
        self.unit_evicted = self.unit_inserted = 0
        if mode == "record":
            self.journal.arm(self.rng.randint(1, 20), fault)
        elif mode == "between":
            self.between = fault
        try:
            with self.journal.unit():
                body()
                if mode != "complete":
                    raise fault
        except BaseException as e:
            if e is not fault:
                raise
            unfired = self.journal.disarm()
            if mode == "record" and not unfired:
                self.stats["faults_in_op"] += 1
            elif mode == "between" and self.between is not None:
                self.stats["faults_at_end"] += 1
            elif mode in ("record", "end"):
                self.stats["faults_at_end"] += 1
            self.stats["keyboard_interrupts"] += isinstance(e, KeyboardInterrupt)
            self.between = None
            self._restore(saved)
            assert self.canonical() == snapshot, "a broken unit left changes behind"
            self.full_check()
            self.stats["rollbacks"] += 1
            self.stats["evictions_undone"] += self.unit_evicted
            self.stats["inserts_undone"] += self.unit_inserted
            return False
        finally:
            self.in_unit = False
        self.journal.disarm()
        self.between = None
        self.full_check()
        self.stats["units_committed"] += 1
        return True


# --- the random driver ----------------------------------------------------------------------
class Driver:
    def __init__(self, world: World) -> None:
        self.w, self.rng = world, world.rng

    def prompt(self) -> list[int]:
        rng, w = self.rng, self.w
        others = [s.token_ids for s in w.running + w.waiting]
        if others and rng.random() < 0.5:
            base = rng.choice(others)
            base = base[:rng.randint(1, len(base))]  # a sibling, or a shared prefix
            tail = [rng.randrange(ALPHABET) for _ in range(rng.randint(0, 6))]
            return (base + tail)[:16]
        return [rng.randrange(ALPHABET) for _ in range(rng.randint(2, 14))]

    def arrivals(self) -> None:
        w = self.w
        while len(w.running) + len(w.waiting) < 12 and self.rng.random() < 0.6:
            tokens = self.prompt()
            if len(tokens) >= 2:
                w.new_seq(tokens)

    def idle_ops(self) -> None:
        """Between steps: aborts, caching, truncation (drafter rollback), multi-turn growth."""
        rng, w = self.rng, self.w
        for _ in range(rng.randint(1, 4)):
            r = rng.random()
            if r < 0.2 and w.running:
                w.release(rng.choice(w.running), keep_kv=rng.random() < 0.7,
                          requeue=rng.random() < 0.5)
            elif r < 0.45 and w.running:
                w.cache_computed(rng.choice(w.running))
            elif r < 0.7 and w.running:
                seq = rng.choice(w.running)
                w.truncate(seq, rng.randint(0, seq.num_computed))
            elif r < 0.9 and w.running + w.waiting:
                seq = rng.choice(w.running + w.waiting)
                room = MAX_LEN - 2 - seq.num_tokens
                if room > 0:
                    n = rng.randint(1, min(3, room))
                    w.append(seq, [rng.randrange(ALPHABET) for _ in range(n)])
            elif rng.random() < 0.3:
                w.clear_cache()
            w.boundary()

    def schedule(self) -> None:
        """Grow running sequences (preempting the newest unscheduled when short), make
        scratch allocations that force evictions, admit waiting ones."""
        rng, w = self.rng, self.w
        scheduled: set[int] = set()
        if rng.random() < 0.25:  # the pool runs short: growth below evicts, then preempts
            w.scratch(max(1, w.kv.available - rng.randint(0, 6)))
            w.boundary()
        decodes = [s for s in w.running if s.num_tokens - s.num_computed == 1]
        if decodes and rng.random() < 0.5 and w.grow_decodes(decodes):
            scheduled.update(s.seq_id for s in decodes)
            w.boundary()
        for seq in list(w.running):
            if seq not in w.running or seq.seq_id in scheduled or rng.random() < 0.2:
                continue
            todo = seq.num_tokens - seq.num_computed
            n = rng.randint(1, todo)
            while not w.grow(seq, n):
                victims = [s for s in w.running if s.seq_id not in scheduled and s is not seq]
                if not victims or rng.random() < 0.15:
                    break
                w.release(victims[-1], keep_kv=True, requeue=True)
                w.stats["preempted"] += 1
                w.boundary()
            else:
                scheduled.add(seq.seq_id)
            w.boundary()
        for _ in range(rng.randint(0, 2)):
            if rng.random() < 0.4:
                w.scratch(rng.randint(1, w.kv.available + 4))
                w.boundary()
        for _ in range(rng.randint(0, 3)):
            if w.waiting:
                w.admit(rng.choice(w.waiting))
                w.boundary()

    def commit(self) -> None:
        """Per item: advance what was kept, free the rest, sample a token at the end, cache a
        finished prompt, finish some; then drafter-style truncations; then settle."""
        rng, w = self.rng, self.w
        for it in list(w.items):
            if it.seq is None:
                w.free(it.slots)
                w.boundary()
                continue
            seq, n = it.seq, len(it.slots)
            assert it.start == seq.num_computed
            r = rng.random()
            m = 0 if r < 0.08 else rng.randint(0, n - 1) if r < 0.18 else n
            if m:
                w.advance(seq, m, it.slots[:m])
            if m < n:
                w.free(it.slots[m:])
            sampled = it.start + m == seq.num_tokens
            if sampled:
                w.append(seq, [rng.randrange(ALPHABET)])
            w.boundary()
            if r < 0.08:  # the request failed: it ends, its K/V kept or not
                w.release(seq, keep_kv=rng.random() < 0.5, requeue=False)
            elif sampled and (it.start < seq.num_prompt or rng.random() < 0.1):
                w.cache_computed(seq)
            if seq in w.running and sampled and (seq.num_tokens >= MAX_LEN - 1
                                                 or rng.random() < 0.12):
                w.release(seq, keep_kv=rng.random() < 0.8, requeue=False)
            w.boundary()
        for _ in range(rng.randint(0, 2)):
            if w.running and rng.random() < 0.5:
                seq = rng.choice(w.running)
                w.truncate(seq, rng.randint(0, seq.num_computed))
                w.boundary()
        w.settle()

    def block(self, body, after_failure=None) -> None:
        r = self.rng.random()
        if r < 0.45:
            body()
            self.w.full_check()
            return
        if r < 0.6:
            committed = self.w.in_a_unit(body, "complete")
        else:
            fault = KeyboardInterrupt() if self.rng.random() < 0.25 else None
            mode = self.rng.choice(["record", "record", "between", "end"])
            committed = self.w.in_a_unit(body, mode, fault)
        if not committed and after_failure is not None:
            after_failure()

    def after_failed_commit(self) -> None:
        """As the engine does (discard the step's slots), or run the commit again."""
        if self.rng.random() < 0.5:
            self.w.discard_pending()
            self.w.full_check()
        else:
            self.block(self.commit, self.after_failed_commit)

    def step(self) -> None:
        self.arrivals()
        if self.rng.random() < 0.5:
            self.block(self.idle_ops)
        self.block(self.schedule)
        if self.w.items:
            self.w.forward()
        self.block(self.commit, self.after_failed_commit)


@pytest.mark.parametrize("enabled", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_random_transactions_roll_back_exactly(enabled):
    """Hundreds of legal operations per seed, in and out of units; every broken unit (error or
    KeyboardInterrupt, between or inside operations) leaves the bookkeeping exactly as it
    began, and every state agrees with the reference, the naive invariant and kv.check()."""
    total: Counter = Counter()
    for seed in SEEDS:
        w = World(enabled, seed)
        driver = Driver(w)
        for _ in range(STEPS):
            driver.step()
        w.full_check()
        total += w.stats
    print(f"\n{'prefix cache' if enabled else 'no prefix cache'}: {dict(sorted(total.items()))}")
    # The run must have exercised what it claims to.
    assert total["ops"] > 300 * len(SEEDS)
    assert total["rollbacks"] > 50 and total["units_committed"] > 20
    assert total["faults_in_op"] > 20 and total["faults_between"] > 20
    assert total["keyboard_interrupts"] > 10
    assert total["preempted"] > 0 and total["discarded"] > 0
    if enabled:
        assert total["evictions_undone"] > 0 and total["inserts_undone"] > 0
        assert total["splits"] > 0


# --- directed tests -------------------------------------------------------------------------
def prefill(w: World, tokens: list[int]) -> Sequence:
    """Admit and compute a whole prompt, sampling one token (all committed)."""
    seq = w.new_seq(tokens)
    assert w.admit(seq)
    w.forward()
    it = w.items[-1]
    w.advance(seq, len(it.slots), it.slots)
    w.append(seq, [0])
    w.settle()
    w.full_check()
    return seq


def test_undone_eviction_restores_prefixes_with_the_same_slots():
    """Evictions inside a unit that is then undone put the evicted prefixes back, on the same
    slots, and the free stack back in its order."""
    w = World(True, num_slots=24)
    for tokens in ([0, 1, 2, 3, 0, 1], [0, 1, 3, 3, 2], [2, 2, 1]):
        w.release(prefill(w, tokens), keep_kv=True, requeue=False)
    cached = tree_map(w.cache)
    assert len(cached) == 12
    snapshot = w.canonical()

    def evict_all():
        slots = w.alloc(w.kv.num_slots)  # every slot: all cached prefixes evicted
        assert slots is not None and not w.ref.tree and not list(w.cache.nodes())
        assert {s for s, _ in cached.values()} <= set(slots)

    assert not w.in_a_unit(evict_all, "end")
    assert tree_map(w.cache) == cached
    assert w.canonical() == snapshot
    assert w.stats["evictions_undone"] == 12


def failing_second_free(w: World, fault: BaseException, monkeypatch) -> list:
    """Three cached prefixes, and the pool's 2nd free from now on raising `fault` (a device
    error in its copy); returns the frees' slots so far."""
    for tokens in ([0, 1, 2, 3, 0, 1], [0, 1, 3, 3, 2], [2, 2, 1]):
        w.release(prefill(w, tokens), keep_kv=True, requeue=False)
    free, calls = w.kv.pool.free, []

    def failing_free(slots):
        calls.append(slots)
        if len(calls) == 2:
            raise fault
        free(slots)

    monkeypatch.setattr(w.kv.pool, "free", failing_free)
    return calls


@pytest.mark.parametrize("fault", [InjectedFault("x"), KeyboardInterrupt()],
                         ids=["error", "keyboard_interrupt"])
@pytest.mark.parametrize("evict", ["alloc_in_a_unit", "clear_cache_alone"])
def test_an_eviction_failing_half_way_is_undone_too(evict, fault, monkeypatch):
    """A free failing between two evicted nodes: the unit's undo puts every evicted prefix
    back, on its slots (the detached nodes had been lost, their slots leaked for the engine's
    life). clear_cache, which a weight update calls after its copies outside any unit, is a
    unit of its own; once it succeeds every slot is free."""
    w = World(True, num_slots=24)
    calls = failing_second_free(w, fault, monkeypatch)
    cached = tree_map(w.cache)
    snapshot = w.canonical()
    if evict == "alloc_in_a_unit":
        assert not w.in_a_unit(lambda: w.alloc(w.kv.num_slots), "end", fault)
    else:
        with pytest.raises(type(fault)):
            w.kv.clear_cache()
    monkeypatch.undo()
    assert len(calls) == 2 and not w.journal.recording
    assert tree_map(w.cache) == cached
    assert w.canonical() == snapshot
    if evict == "clear_cache_alone":
        w.kv.clear_cache()
        assert w.kv.pool.num_free == 24 and not list(w.cache.nodes())


@pytest.mark.parametrize("fault", [InjectedFault("x"), KeyboardInterrupt()],
                         ids=["error", "keyboard_interrupt"])
def test_undone_insert_after_a_split_of_the_inserted_edge_removes_both_halves(fault):
    """cache_computed inserts an edge; a match on a partial prefix inside the same unit splits
    it; undoing the unit removes both halves (and the unlocked [0, 1] stays)."""
    w = World(True)
    w.release(prefill(w, [0, 1, 3]), keep_kv=True, requeue=False)  # caches 0 1 3
    seq = prefill(w, [0, 1, 2, 3, 1, 1])  # matches 0 1; computes 2 3 1 1 privately
    before = tree_map(w.cache)
    snapshot = w.canonical()

    def body():
        w.cache_computed(seq)  # inserts the edge 2 3 1 1 under 0 1
        assert (0, 1, 2, 3, 1, 1) in w.ref.tree
        nodes = sum(1 for _ in w.cache.nodes())
        w.match([0, 1, 2, 3])  # cuts that edge after 2 3
        assert sum(1 for _ in w.cache.nodes()) == nodes + 1

    assert not w.in_a_unit(body, "end", fault)
    assert tree_map(w.cache) == before
    assert not any(p[:3] == (0, 1, 2) for p in tree_map(w.cache))
    assert w.canonical() == snapshot


def test_discard_pending_after_a_failed_step_returns_exactly_the_pending_slots():
    """Scheduling commits its allocations; the commit unit fails after advancing, caching,
    releasing and settling; its undo brings the pending list back, and discard_pending then
    frees exactly those slots, leaving a consistent state."""
    w = World(True, num_slots=40)
    old = prefill(w, [1, 2, 3, 0])
    a, b = w.new_seq([1, 2, 3, 0, 2, 2]), w.new_seq([3, 3, 3])
    assert w.admit(a) and w.admit(b) and w.grow(old, 1)
    w.scratch(w.kv.available - 2)  # a scratch allocation: pending too
    w.full_check()
    w.forward()
    pending = [s for it in w.items for s in it.slots]
    assert sorted(pending) == sorted(s for p in w.kv.pending for s in p.tolist())

    def commit():
        for it in w.items:
            if it.seq is None:
                w.free(it.slots)
                continue
            w.advance(it.seq, len(it.slots), it.slots)
            w.append(it.seq, [1])
        w.cache_computed(a)
        w.release(old, keep_kv=True, requeue=False)
        w.release(b, keep_kv=False, requeue=False)
        w.settle()
        assert w.kv.pending == [] and w.ref.tree

    assert not w.in_a_unit(commit, "end")
    assert sorted(s for p in w.kv.pending for s in p.tolist()) == sorted(pending)
    free_before = w.pool.free_slots().tolist()
    w.discard_pending()
    assert sorted(w.pool.free_slots().tolist()) == sorted(free_before + pending)
    assert w.kv.pending == []
    w.full_check()


def test_no_prefix_cache_release_with_keep_kv_returns_every_slot():
    """With prefix caching off nothing is cached: release(keep_kv=True) frees every slot the
    sequence held, and after all sequences leave the whole pool is free."""
    w = World(False)
    seqs = [prefill(w, tokens) for tokens in ([0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 1, 0, 2])]
    for seq in seqs:
        assert seq.cached_len == 0
        w.cache_computed(seq)
        assert seq.cached_len == 0 and w.cache.total_size == 0
    assert w.pool.num_free == NUM_SLOTS - sum(s.num_computed for s in seqs)
    for seq in seqs:
        held = w.kv.private_slots(seq).tolist()
        w.release(seq, keep_kv=True, requeue=False)
        assert set(held) <= set(w.pool.free_slots().tolist())
    assert w.pool.num_free == NUM_SLOTS
    assert sorted(w.pool.free_slots().tolist()) == list(range(NUM_SLOTS))
    w.full_check()


@pytest.mark.parametrize("enabled", [True, False], ids=["prefix_cache", "no_prefix_cache"])
@pytest.mark.parametrize("case", ["release_then_admit", "truncate_then_grow"])
def test_rollback_restores_a_reused_row(enabled, case):
    """A unit that frees computed positions of a row and then writes the row again (a released
    row reused by attach/place, or truncated positions grown again) must restore the row's
    computed slots when it is undone."""
    w = World(enabled, num_slots=16)
    a = prefill(w, [0, 1, 2, 3])
    b = w.new_seq([3, 3])

    def body():
        if case == "release_then_admit":
            w.release(a, keep_kv=False, requeue=True)
            assert w.admit(b)  # takes a's row; place overwrites its positions 0..1
        else:
            w.truncate(a, 1)
            assert w.grow(a, 2)  # places over positions 1..2

    assert not w.in_a_unit(body, "end")


def test_a_failed_alloc_inside_a_unit_keeps_its_holds_and_cached_prefixes():
    """An alloc that cannot succeed even with every hold released and every cached prefix
    evicted changes nothing inside a unit (the scheduler then preempts and asks again): the
    holds had been dropped for nothing, and a turn's kept K/V lost. The next alloc that
    the released slots suffice for does drop the hold."""
    w = World(True, num_slots=16)
    w.release(prefill(w, [0, 1, 2, 3, 0]), keep_kv=True, requeue=False)  # 5 cached
    running = prefill(w, [3, 3, 3, 3, 3, 3, 3, 3, 2])  # 9 slots in use: 2 free
    _, node = w.kv.match([0, 1, 2, 3, 0])
    w.kv.hold("turn", node)
    assert (w.pool.num_free, w.cache.evictable_size) == (2, 0)
    with w.journal.unit():
        assert w.kv.alloc(8) is None  # 2 free + 5 held: 7
        assert "turn" in w.kv.holds and w.kv.holds_dropped == 0
        assert (w.pool.num_free, w.cache.total_size, w.cache.evictable_size) == (2, 5, 0)
        slots = w.kv.alloc(7)
    assert slots is not None and slots.numel() == 7 and not w.kv.holds
    assert w.kv.holds_dropped == 1 and running.num_computed == 9


def test_a_partial_rollback_that_fails_is_a_rollback_failure():
    """rollback_to takes its segment out of the unit's log before undoing it: an undo that
    raises there leaves the rest of the segment undone for good, which only RollbackFailed
    (the engine then refuses every call) may report, not the undo's own error."""
    journal, undone = Journal(), []

    def broken():
        raise RuntimeError("an undo failing")

    with pytest.raises(RollbackFailed) as failed:
        with journal.unit():
            journal.record(lambda: undone.append("before the savepoint"))
            point = journal.savepoint()
            journal.record(lambda: undone.append("first"))
            journal.record(broken)
            journal.rollback_to(point)
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert undone == ["before the savepoint"] and not journal.recording
