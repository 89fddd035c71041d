"""RadixCache against a token-level reference, with a real KVPool supplying the slots.

The reference stores one entry per cached prefix (tuple of tokens -> slot of its last token),
which is the tree with every edge cut down to one token. Since the tree's edges are an
implementation detail, the reference never models them; it learns which prefixes an eviction
removed from the slots that came back to the pool, and then checks that the removal was legal
(unlocked, whole subtrees, least recently used first).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollout.kv.pool import KVPool
from rollout.kv.prefix_cache import make_prefix_cache
from rollout.kv.radix_cache import RadixCache, RadixNode

CPU = torch.device("cpu")
NUM_SLOTS = 96
# A 4-letter alphabet makes sequences share prefixes and diverge inside edges all the time.
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=9)


def make_cache(num_slots: int = NUM_SLOTS, enabled: bool = True) -> tuple[KVPool, RadixCache]:
    pool = KVPool(num_layers=1, num_slots=num_slots, kv_heads=1, head_dim=1,
                  dtype=torch.float32, device=CPU)
    return pool, make_prefix_cache(enabled, CPU)


def evict(pool: KVPool, cache: RadixCache, n: int) -> int:
    """Evict as the KV manager does (the tree detaches nodes, the pool takes their slots);
    returns the number of slots freed."""
    nodes = cache.evict(n)
    for node in nodes:
        pool.free(node.value)
    return sum(len(node.key) for node in nodes)


def node_path(cache: RadixCache, node) -> list[int]:
    keys = []
    while node is not cache.root:
        keys.append(node.key)
        node = node.parent
    return [t for key in reversed(keys) for t in key]


class Reference:
    """prefix tuple -> slot of its last token, and the tick of its last touch."""

    def __init__(self) -> None:
        self.slot: dict[tuple[int, ...], int] = {}
        self.tick: dict[tuple[int, ...], int] = {}
        self.now = 0

    def match_len(self, tokens) -> int:
        n = 0
        while n < len(tokens) and tuple(tokens[:n + 1]) in self.slot:
            n += 1
        return n

    def slots(self, tokens, n: int) -> list[int]:
        return [self.slot[tuple(tokens[:i])] for i in range(1, n + 1)]

    def touch(self, tokens, n: int) -> None:
        for i in range(1, n + 1):
            self.tick[tuple(tokens[:i])] = self.now

    def match(self, tokens) -> int:
        self.now += 1
        n = self.match_len(tokens)
        self.touch(tokens, n)
        return n

    def insert(self, tokens, slots: list[int]) -> int:
        self.now += 1
        already = self.match_len(tokens)
        for i in range(already, len(tokens)):
            self.slot[tuple(tokens[:i + 1])] = slots[i]
        self.touch(tokens, len(tokens))
        return already


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool, self.cache = make_cache()
        self.ref = Reference()
        self.locks: list[tuple[object, tuple[int, ...]]] = []  # (node, locked prefix)
        self.held: list[torch.Tensor] = []  # private slots, like a request's uncached tail
        # In-flight requests: matched and locked at admission, inserted at the end.
        self.requests: list[tuple[list[int], torch.Tensor, object, torch.Tensor]] = []
        self.seen: list[list[int]] = []

    # --- helpers --------------------------------------------------------------------------
    def locked_prefixes(self) -> set[tuple[int, ...]]:
        pins = [p for _, p in self.locks] + [tuple(t[:c.numel()]) for t, c, _, _ in self.requests]
        return {p[:i] for p in pins for i in range(1, len(p) + 1)}

    def checked_match(self, tokens):
        expected = self.ref.match(tokens)
        slots, node = self.cache.match_prefix(tokens)
        assert slots.numel() == expected, (tokens, slots.tolist(), expected)
        assert slots.tolist() == self.ref.slots(tokens, expected)
        # The node ends exactly at the matched prefix, so locking it pins no more and no less.
        assert node_path(self.cache, node) == list(tokens[:expected])
        return slots, node

    def checked_evict(self, n: int) -> int:
        before = self.pool.num_free
        locked = self.locked_prefixes()
        # Node boundaries before the eviction: it must take whole nodes, and stop as soon as
        # it has enough.
        nodes = {}
        for node in self.cache.nodes():
            path = tuple(node_path(self.cache, node))
            nodes[path] = len(node.key)
        evictable = len(self.ref.slot) - len(locked)
        assert self.cache.evictable_size == evictable
        freed = evict(self.pool, self.cache, n)
        back = self.pool.free_slots()[before:].tolist()
        assert len(back) == freed, "evict reported a different count than it freed"
        owner = {s: p for p, s in self.ref.slot.items()}
        assert len(set(back)) == len(back) and all(s in owner for s in back), \
            "evict freed slots that were not in the tree"
        removed = {owner[s] for s in back}
        assert not removed & locked, "evict freed a locked node or an ancestor of one"
        for p in self.ref.slot:
            if p[:-1] in removed:
                assert p in removed, f"evict freed {p[:-1]} but kept its child {p}"
        if freed < n:
            assert freed == evictable, "evict stopped early with unlocked nodes left"
        else:
            assert freed >= n
        for path, size in nodes.items():
            gone = [path[:len(path) - i] in removed for i in range(size)]
            assert all(gone) or not any(gone), f"evict freed part of the node ending at {path}"
        if removed:
            # The last node freed is the newest (the topmost of equally new ones: a parent
            # only becomes a leaf after its children go); without it, evict had too little.
            ends = [p for p in nodes if p in removed]
            last = min(ends, key=lambda p: (-self.ref.tick[p], len(p)))
            assert freed - nodes[last] < n, f"evict freed {freed} for {n}: one node too many"
            # Leaves leave in LRU order and a parent is never older than its children, so
            # nothing evicted may be newer than an unlocked leaf that stayed.
            newest_evicted = max(self.ref.tick[p] for p in removed)
            remaining = set(self.ref.slot) - removed
            parents = {p[:-1] for p in remaining}
            for p in remaining - parents - locked:
                assert self.ref.tick[p] >= newest_evicted, \
                    f"evict kept leaf {p} (tick {self.ref.tick[p]}) over a newer one " \
                    f"(tick {newest_evicted})"
        for p in removed:
            del self.ref.slot[p]
            del self.ref.tick[p]
        return freed

    def alloc(self, n: int) -> torch.Tensor | None:
        short = n - self.pool.num_free
        if short > 0:
            self.checked_evict(short)
        if n > self.pool.num_free:
            return None
        return self.pool.alloc(n)

    def remember(self, tokens) -> None:
        self.seen.append(list(tokens))
        del self.seen[:-12]

    # --- rules ----------------------------------------------------------------------------
    @rule(tokens=TOKENS)
    def insert_fresh(self, tokens):
        slots = self.alloc(len(tokens))
        if slots is None:
            return
        expected = self.ref.insert(tokens, slots.tolist())
        already = self.cache.insert(tokens, slots)
        assert already == expected
        self.pool.free(slots[:already])  # duplicates of cached tokens go back, as in the engine
        self.remember(tokens)

    @precondition(lambda self: self.seen)
    @rule(pick=st.integers(0, 100), cut=st.integers(0, 9), suffix=st.lists(st.integers(0, 3),
                                                                          max_size=4))
    def insert_related(self, pick, cut, suffix):
        """A sequence sharing a prefix with an earlier one: splits edges at chosen points."""
        base = self.seen[pick % len(self.seen)]
        tokens = base[:cut] + suffix
        if tokens:
            self.insert_fresh(tokens)

    @rule(tokens=TOKENS)
    def match(self, tokens):
        self.checked_match(tokens)

    @precondition(lambda self: self.seen)
    @rule(pick=st.integers(0, 100), cut=st.integers(1, 9))
    def match_seen(self, pick, cut):
        """Refreshes a cached path, so that the LRU order differs from insertion order."""
        self.checked_match(self.seen[pick % len(self.seen)][:cut])

    @precondition(lambda self: self.seen)
    @rule(pick=st.integers(0, 100), cut=st.integers(1, 9))
    def match_and_lock(self, pick, cut):
        tokens = self.seen[pick % len(self.seen)][:cut]
        _, node = self.checked_match(tokens)
        self.cache.lock(node)
        self.locks.append((node, tuple(node_path(self.cache, node))))

    @precondition(lambda self: self.locks)
    @rule(pick=st.integers(0, 100))
    def unlock(self, pick):
        node, _ = self.locks.pop(pick % len(self.locks))
        self.cache.unlock(node)

    @rule(tokens=TOKENS)
    def admit_request(self, tokens):
        """The engine's pattern: lock the matched prefix, hold private slots for the rest."""
        cached, node = self.checked_match(tokens)
        self.cache.lock(node)
        # Registered before allocating: the eviction that allocation may trigger must see the
        # lock.
        self.requests.append((list(tokens), cached, node, cached[:0]))
        fresh = self.alloc(len(tokens) - cached.numel())
        if fresh is None:
            self.requests.pop()
            self.cache.unlock(node)
            return
        self.requests[-1] = (list(tokens), cached, node, fresh)
        self.remember(tokens)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 100))
    def finish_request(self, pick):
        tokens, cached, node, fresh = self.requests.pop(pick % len(self.requests))
        # The locked prefix cannot have been evicted, so its slots are still the tree's.
        assert self.cache.peek(tokens[:cached.numel()]).tolist() == cached.tolist()
        slots = torch.cat([cached, fresh])
        expected = self.ref.insert(tokens, slots.tolist())
        already = self.cache.insert(tokens, slots)
        assert already == expected >= cached.numel()
        self.pool.free(slots[cached.numel():already])
        self.cache.unlock(node)

    @rule(n=st.one_of(st.integers(1, 3), st.integers(1, 24)))
    def evict(self, n):
        self.checked_evict(n)

    @rule(tokens=TOKENS)
    def peek(self, tokens):
        state = [(id(n), n.last_access, n.lock_ref, tuple(n.key)) for n in self.cache.nodes()]
        expected = self.ref.match_len(tokens)
        assert self.cache.prefix_len(tokens) == expected
        assert self.cache.peek(tokens).tolist() == self.ref.slots(tokens, expected)
        after = [(id(n), n.last_access, n.lock_ref, tuple(n.key)) for n in self.cache.nodes()]
        assert after == state, "peek changed the tree"

    @rule(n=st.integers(1, 6))
    def hold(self, n):
        slots = self.alloc(n)
        if slots is not None:
            self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 100))
    def release(self, pick):
        self.pool.free(self.held.pop(pick % len(self.held)))

    # --- invariants -----------------------------------------------------------------------
    @invariant()
    def bookkeeping(self):
        self.cache.check()
        locked = self.locked_prefixes()
        assert self.cache.total_size == len(self.ref.slot)
        assert self.cache.protected_size == len(locked)

    @invariant()
    def every_slot_in_one_place(self):
        parts = [self.pool.free_slots(), self.cache.all_slots(), *self.held]
        parts += [fresh for _, _, _, fresh in self.requests]
        every = torch.cat(parts).sort().values
        assert torch.equal(every, torch.arange(NUM_SLOTS)), "a slot is lost or in two places"
        assert sorted(self.cache.all_slots().tolist()) == sorted(self.ref.slot.values())

    @invariant()
    def tree_equals_reference(self):
        pins = [p for _, p in self.locks] + [tuple(t[:c.numel()]) for t, c, _, _ in self.requests]
        for node in self.cache.nodes():
            path = node_path(self.cache, node)
            start = len(path) - len(node.key)
            for i, slot in enumerate(node.value.tolist()):
                assert self.ref.slot.get(tuple(path[:start + i + 1])) == slot
            expected_locks = sum(1 for p in pins if tuple(path) == p[:len(path)])
            assert node.lock_ref == expected_locks, (path, node.lock_ref, expected_locks)


RadixMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], derandomize=True)
TestRadixAgainstReference = RadixMachine.TestCase


# --- plain unit tests ---------------------------------------------------------------------
def insert_new(pool: KVPool, cache: RadixCache, tokens: list[int]) -> torch.Tensor:
    slots = pool.alloc(len(tokens))
    already = cache.insert(tokens, slots)
    pool.free(slots[:already])
    return slots


def test_match_splits_edge_in_the_middle():
    pool, cache = make_cache()
    slots = insert_new(pool, cache, [1, 2, 3, 4])
    got, node = cache.match_prefix([1, 2, 9])
    assert got.tolist() == slots[:2].tolist()
    assert node.key == [1, 2] and node.value.tolist() == slots[:2].tolist()
    (lower,) = node.children.values()
    assert lower.key == [3, 4] and lower.parent is node
    cache.check()
    got, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert got.tolist() == slots.tolist() and node is lower
    assert cache.total_size == 4 and cache.evictable_size == 4


def test_split_keeps_locks_of_the_lower_half():
    pool, cache = make_cache()
    insert_new(pool, cache, [1, 2, 3, 4])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.lock(node)
    _, upper = cache.match_prefix([1, 2])
    assert upper.lock_ref == 1 and node.parent is upper
    cache.check()
    cache.unlock(node)
    assert upper.lock_ref == 0 and cache.evictable_size == 4 and cache.protected_size == 0
    cache.check()


def test_insert_of_cached_prefix_returns_its_length():
    pool, cache = make_cache()
    slots = insert_new(pool, cache, [1, 2, 3, 4])
    free = pool.num_free
    assert insert_new(pool, cache, [1, 2]).numel() == 2
    assert pool.num_free == free, "the duplicate slots must be left to the caller to free"
    extra = pool.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], extra) == 4
    pool.free(extra[:4])
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == slots.tolist() + [extra[4].item()]
    assert cache.insert([7], pool.alloc(1)) == 0
    cache.check()


def test_evict_skips_locked_paths():
    pool, cache = make_cache()
    a = insert_new(pool, cache, [1, 2, 3])
    b = insert_new(pool, cache, [1, 5, 6])
    _, node = cache.match_prefix([1, 2, 3])
    cache.lock(node)
    free = pool.num_free
    assert evict(pool, cache, 100) == 2
    assert sorted(pool.free_slots()[free:].tolist()) == sorted(b[1:].tolist())
    assert cache.match_prefix([1, 2, 3])[0].tolist() == a.tolist()
    assert cache.prefix_len([1, 5, 6]) == 1
    cache.unlock(node)
    assert evict(pool, cache, 100) == 3 and cache.total_size == 0
    assert pool.num_free == NUM_SLOTS
    cache.check()


def test_evict_frees_whole_leaves_then_the_parents_they_expose():
    pool, cache = make_cache()
    insert_new(pool, cache, [1, 2, 3])
    insert_new(pool, cache, [1, 2, 4, 4])  # splits [1, 2, 3] into [1, 2] + [3]
    assert evict(pool, cache, 1) == 1  # [3]: the least recently used leaf, one token
    assert cache.prefix_len([1, 2, 3]) == 2
    assert evict(pool, cache, 1) == 2  # [4, 4] goes whole
    assert evict(pool, cache, 1) == 2  # then the exposed parent [1, 2]
    assert cache.total_size == 0 and pool.num_free == NUM_SLOTS
    cache.check()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_eviction_that_fails_half_way_detaches_nothing(monkeypatch, error):
    """The caller records its undo once evict returns: a failure inside it (the heap's
    comparisons are Python code) must leave every node attached, not some of them lost with
    their slots."""
    pool, cache = make_cache()
    for t in range(4):
        insert_new(pool, cache, [t, t])
    before = (cache.total_size, cache.evictable_size, sorted(n.key[0] for n in cache.nodes()))
    calls = 0

    def failing(self, other):
        nonlocal calls
        calls += 1
        if calls == 6:  # after the heap is built and some leaves are detached
            raise error("in a comparison")
        return self.last_access < other.last_access

    monkeypatch.setattr(RadixNode, "__lt__", failing)
    with pytest.raises(error):
        cache.evict(100)
    assert calls == 6  # the rig held
    monkeypatch.undo()
    assert (cache.total_size, cache.evictable_size,
            sorted(n.key[0] for n in cache.nodes())) == before
    cache.check()
    assert evict(pool, cache, 100) == 8 and pool.num_free == NUM_SLOTS


def test_evict_is_least_recently_used_first():
    pool, cache = make_cache()
    leaves = {t: insert_new(pool, cache, [t, t]) for t in range(4)}
    cache.match_prefix([0, 0])
    insert_new(pool, cache, [2, 2])  # re-inserting touches too
    order = []
    for _ in range(4):
        free = pool.num_free
        assert evict(pool, cache, 1) == 2
        freed = pool.free_slots()[free:].tolist()
        order.append(next(t for t, s in leaves.items() if s.tolist() == freed))
    assert order == [1, 3, 0, 2]


def test_evict_ignores_a_partial_match_for_recency_of_the_rest():
    pool, cache = make_cache()
    insert_new(pool, cache, [0, 1, 2, 3])
    insert_new(pool, cache, [3])
    cache.match_prefix([0, 1])  # touches only the split-off [0, 1]; [2, 3] stays old
    free = pool.num_free
    assert evict(pool, cache, 1) == 2
    assert cache.prefix_len([0, 1, 2, 3]) == 2 and cache.prefix_len([3]) == 1
    assert pool.num_free == free + 2


def test_disabled_cache_matches_nothing():
    pool, cache = make_cache(enabled=False)
    slots = pool.alloc(3)
    assert cache.insert([1, 2, 3], slots) == 0
    got, node = cache.match_prefix([1, 2, 3])
    assert got.numel() == 0 and node is cache.root
    assert cache.prefix_len([1, 2, 3]) == 0 and cache.peek([1]).numel() == 0
    assert evict(pool, cache, 10) == 0
    assert cache.all_slots().numel() == 0 and cache.total_size == 0
    cache.check()
