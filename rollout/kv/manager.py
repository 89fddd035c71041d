"""The KV manager: the one owner of KV slots.

It holds the pool (free slots), the prefix cache (slots of cached tokens), the slot table (each
attached sequence's slots in token order) and the KV bookkeeping of every attached sequence:
`token_ids[:num_computed]` have K/V; the slots of the first `cached_len` belong to the tree
(pinned by locking `seq.node`), the rest are the sequence's private tail. Slots allocated for a
step's new positions are pending until the step commits (`settle`) or fails
(`discard_pending`).

Invariant (`check`): every slot is in exactly one place: the free list, a tree node, one
attached sequence's private tail, or the pending list; lock counts equal the attached
sequences and holds pinning each node.

Every change is recorded in the journal, so a unit of a step can be undone whole.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from ..journal import Journal
from .pool import KVPool
from .slot_table import SlotTable

if TYPE_CHECKING:  # the manager reads a sequence's slots; requests/ sits above kv/
    from ..requests.sequence import Sequence

# Consecutive slots a decoding sequence takes (alloc_decodes): 32 tokens x 768 bytes a layer
# for SmolLM2-135M's K (and as much V) are runs the CPU's prefetchers follow.
DECODE_RUN = 32


class KVManager:
    def __init__(self, pool: KVPool, cache, table: SlotTable, journal: Journal) -> None:
        self.pool, self.cache, self.table, self.journal = pool, cache, table, journal
        self.attached: dict[int, Sequence] = {}  # seq_id -> sequence
        self.pending: list[torch.Tensor] = []
        # Finished sequences' cached tokens kept locked (an episode's KV while its environment
        # runs), oldest first; released when memory runs short.
        self.holds: dict[object, object] = {}  # key -> radix node
        self.cache_hit_tokens = 0  # tokens matched in the tree at attach
        self.prompt_hit_tokens = 0  # of them, a sample's prompt at its first attach
        self.holds_dropped = 0  # holds released under memory pressure
        self.stale_tags = 0  # keep_stale calls so far: each tags its K/V with a new number
        # alloc_decodes' arrangement: (sequences, free slots left by the last allocation,
        # allocations it still serves)
        self._runs: tuple[int, int, int] | None = None

    # --- capacity ---------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def available(self) -> int:
        """Slots an allocation can get: free ones and unlocked cached ones."""
        return self.pool.num_free + self.cache.evictable_size

    @property
    def kv_label(self) -> int:
        """The tag the K/V computed now takes at the next keep_stale: what tells it apart from
        other weights' K/V of the same tokens (Sequence.kv_bounds)."""
        return self.stale_tags + 1

    @property
    def shares_prefixes(self) -> bool:
        return self.cache.shares_prefixes

    def prefix_len(self, tokens) -> int:
        return self.cache.prefix_len(tokens)

    # --- slots ------------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots for new positions, evicting least recently used cached prefixes if short
        (and releasing holds, oldest first, if still short); None when even that leaves too
        few, and then, inside a unit, nothing was evicted or released: the caller preempts a
        sequence and asks again, and the holds that its freed slots make unnecessary stay.
        Pending until the step settles."""
        point = self.journal.savepoint()
        short = n - self.pool.num_free
        if short > 0:
            self._evict(short)
        while n > self.pool.num_free and self._drop_oldest_hold():
            self._evict(n - self.pool.num_free)
        if n > self.pool.num_free:
            self.journal.rollback_to(point)
            return None
        slots = self.pool.alloc(n)
        self.journal.record(lambda: self.pool.free(slots))
        self.pending.append(slots)
        self.journal.record(self.pending.pop)
        return slots

    def alloc_decodes(self, n: int, seqs: list[Sequence] | None = None) -> torch.Tensor | None:
        """alloc(n) for the next position of each of n decoding sequences (`seqs`, listed in
        the same order every step). Left alone, one step's n slots are consecutive, so each
        sequence's own tokens lie n slots apart and attention reads them one scattered row at
        a time; so the free list is arranged DECODE_RUN steps ahead (KVPool.arrange_runs) and
        each sequence takes consecutive slots until the batch changes. When it changes (a
        sample ended: with EOS honoured, every step or two), each sequence of a CPU pool goes
        on with the free slots right after its newest one where there are any: re-arranged
        from the free list's top alone, a sample's tokens lay in runs of 2-2.5 slots
        (docs/benchmarks.md). Only which free slot goes where changes: nothing is reserved or
        owned."""
        pool, runs = self.pool, self._runs
        if runs is not None and runs[:2] == (n, pool.num_free) and runs[2] > 0:
            left = runs[2]
        else:
            left = min(DECODE_RUN, pool.num_free // max(n, 1))
            if left > 1:
                # On a GPU the arrangement's data-dependent selection would wait for the
                # device, and its attention reads slots through an index anyway.
                after = (self.table.read_each([s.row for s in seqs],
                                              [s.num_computed - 1 for s in seqs])
                         if seqs is not None and pool.device.type == "cpu" else None)
                old = pool.arrange_runs(n, left, after)
                self.journal.record(lambda: pool.restore_order(old))
        slots = self.alloc(n)
        if slots is not None:
            self._runs = (n, pool.num_free, left - 1)
            self.journal.record(lambda: setattr(self, "_runs", runs))
        return slots

    def free(self, slots: torch.Tensor) -> None:
        self.pool.free(slots)
        self.journal.record(lambda: self.pool.unfree(slots))

    def _evict(self, n: int) -> None:
        # The undo is recorded before the first free, and undoes only the frees made: a
        # failure half way (a device error in a free's copy) must not leave detached nodes
        # whose slots nobody frees.
        evicted, freed = self.cache.evict(n), []
        self.journal.record(lambda: self._unevict(evicted, freed))
        for node in evicted:
            self.pool.free(node.value)
            freed.append(node)

    def _unevict(self, evicted, freed) -> None:
        for node in reversed(freed):
            self.pool.unfree(node.value)
        self.cache.unevict(evicted)

    def make_room(self, n: int, release=None) -> bool:
        """Release the hold `release` (a turn's own, pinned by the lock its admission took),
        then holds oldest first, until `n` slots can be allocated; False if they cannot even
        then, every hold then kept (inside a unit: releasing them would buy nothing, and
        their K/V would lose its protection from eviction)."""
        point = self.journal.savepoint()
        if release is not None:
            self.unhold(release)
        while self.available < n and self._drop_oldest_hold():
            pass
        if self.available >= n:
            return True
        self.journal.rollback_to(point)
        return False

    def clear_cache(self) -> None:
        """Release every hold and evict every unlocked cached prefix (its K/V came from
        weights that changed). All or nothing, inside a unit of its own where the caller has
        none (a weight update's, after its copies): an eviction detaches its nodes before it
        frees their slots, and a free failing half way outside a unit had lost the rest of
        them for the engine's life."""
        with self.journal.unit():
            for key in list(self.holds):
                self.unhold(key)
            self._evict(self.cache.total_size)

    def settle(self) -> None:
        """The step's pending slots are accounted for: advanced into sequences or freed."""
        settled = self.pending
        self.journal.record(lambda: setattr(self, "pending", settled))
        self.pending = []

    def discard_pending(self) -> None:
        """A step failed before it settled: its new slots go back to the pool."""
        for slots in self.pending:
            self.pool.free(slots)
        self.pending = []

    # --- tree -------------------------------------------------------------------------------
    def match(self, tokens) -> tuple[torch.Tensor, object]:
        """Slots of the longest cached prefix of `tokens` and the node that ends it (lock it
        before anything can evict it)."""
        return self.cache.match_prefix(tokens)

    def lock(self, node) -> None:
        self.cache.lock(node)
        self.journal.record(lambda: self.cache.unlock(node))

    def unlock(self, node) -> None:
        self.cache.unlock(node)
        self.journal.record(lambda: self.cache.lock(node))

    # --- holds -----------------------------------------------------------------------------
    def hold(self, key, node) -> None:
        """Keep `node` (a finished sequence's cached tokens) locked under `key` until
        `unhold(key)`, or until memory runs short."""
        self.unhold(key)
        self.lock(node)
        self.holds[key] = node
        self.journal.record(lambda: self.holds.pop(key))

    def unhold(self, key) -> bool:
        if key not in self.holds:
            return False
        order = list(self.holds) if self.journal.recording else None
        node = self.holds.pop(key)
        self.journal.record(lambda: self._rehold(order, key, node))
        self.unlock(node)
        return True

    def _rehold(self, order: list, key, node) -> None:
        """Undo of unhold: the hold back in its place (holds are dropped oldest first)."""
        self.holds[key] = node
        kept = [(k, self.holds[k]) for k in order]
        self.holds.clear()
        self.holds.update(kept)

    def _drop_oldest_hold(self) -> bool:
        if not self.holds:
            return False
        self.unhold(next(iter(self.holds)))
        self.journal.add(self, "holds_dropped", 1)
        return True

    # --- sequences --------------------------------------------------------------------------
    def attach(self, seq: Sequence, slots: torch.Tensor, node) -> None:
        """`seq` computes on top of its matched prefix (`slots`, ending at `node`, which the
        caller locked): it gets a table row and starts after the match."""
        self.journal.touch(seq)
        row = self.table.alloc_row()
        self.journal.record(lambda: self.table.free_row(row))
        self.table.write(row, 0, slots)
        matched = slots.numel()
        seq.row, seq.node, seq.cached_len, seq.num_computed = row, node, matched, matched
        seq.computes_from(matched, self.kv_label)
        self.attached[seq.seq_id] = seq
        self.journal.record(lambda: self.attached.pop(seq.seq_id))
        self.journal.add(self, "cache_hit_tokens", matched)
        if not seq.admitted and seq.score is None:  # (score()'s sequences are no samples)
            seq.admitted = True
            self.journal.record(lambda: setattr(seq, "admitted", False))
            self.journal.add(self, "prompt_hit_tokens", min(matched, seq.num_prompt))

    def place(self, seq: Sequence, start: int, slots: torch.Tensor) -> None:
        """Slots for positions start.. of `seq`, not computed yet. (What they overwrite needs
        no undo record: positions that stopped being computed in this unit have one.)"""
        self.table.write(seq.row, start, slots)

    def place_decodes(self, seqs: list[Sequence], slots: torch.Tensor) -> None:
        """slots[i] for the next position of seqs[i], in one device op."""
        self.table.write_each([s.row for s in seqs], [s.num_computed for s in seqs], slots)

    def advance(self, seq: Sequence, n: int) -> None:
        """n more positions of `seq` hold computed K/V."""
        self.journal.touch(seq)
        seq.num_computed += n

    def truncate(self, seq: Sequence, num_computed: int) -> None:
        """Drop the K/V of positions >= num_computed (never below what the tree holds)."""
        num_computed = max(num_computed, seq.cached_len)
        if num_computed < seq.num_computed:
            self.journal.touch(seq)
            freed = self.table.read(seq.row, num_computed, seq.num_computed).clone()
            self.free(freed)
            self._keep_row(seq.row, num_computed, freed)
            seq.num_computed = num_computed

    def cache_computed(self, seq: Sequence, end: int | None = None) -> None:
        """Hand the sequence's computed tokens (the first `end` of them) to the tree and lock
        the node that ends them; private slots that duplicate tokens already cached are
        freed and replaced. With prefix caching off the tree takes nothing and the tail stays
        private."""
        end = seq.num_computed if end is None else min(end, seq.num_computed)
        if end <= seq.cached_len:
            return
        self.journal.touch(seq)
        tokens = seq.cache_key(end)
        slots = self.table.read(seq.row, 0, end).clone()
        already = self.insert(tokens, slots)
        cached, node = self.cache.match_prefix(tokens)
        self.free(slots[seq.cached_len:already])
        self._rewrite(seq.row, cached)
        self.lock(node)
        self.unlock(seq.node)
        seq.node, seq.cached_len = node, cached.numel()

    def insert(self, key: list, slots: torch.Tensor) -> int:
        """Cache `key` (Sequence.cache_key) on `slots`, whose K/V is written; returns how many
        leading tokens the tree held already (their slots stay the caller's)."""
        # The undo is recorded first, from what is cached now: an insert that fails half way
        # is undone too.
        cached_before = self.cache.prefix_len(key)
        self.journal.record(lambda: self.cache.uninsert(key, cached_before))
        return self.cache.insert(key, slots)

    def keep_stale(self, seqs: list[Sequence]) -> int:
        """The weights changed (EngineConfig(carried_kv="park")): everything cached goes as in
        clear_cache, but the K/V the tree holds for `seqs` (waiting samples carried mid-way),
        which stays under a tag of its own (Sequence.kv_tag) that no fresh request's key
        carries; each of them that had K/V cached and no tag takes it. Returns how many
        took one."""
        nodes = []
        for seq in seqs:
            slots, node = self.match(seq.reusable_tokens())
            self.lock(node)
            nodes.append((seq, node, slots.numel()))
        self.clear_cache()
        tag = self.kv_label
        self.journal.add(self, "stale_tags", 1)
        tagged = self.cache.tag_branches(tag)
        self.journal.record(lambda: self.cache.untag_branches(tagged))
        newly = 0
        for seq, node, cached in nodes:
            self.unlock(node)
            if cached and seq.kv_tag is None:
                self.journal.touch(seq)
                seq.kv_tag = tag
                newly += 1
        return newly

    def _rewrite(self, row: int, slots: torch.Tensor) -> None:
        """Computed positions change slots (to the tree's copies): the old ones are kept for
        an undo."""
        old = self.table.read(row, 0, slots.numel()).clone()
        self.table.write(row, 0, slots)
        self.journal.record(lambda: self.table.write(row, 0, old))

    def _keep_row(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Positions start.. of `row` stop being computed; a later write in the same unit (a
        sequence growing again, another one taking the row) must not outlive an undo."""
        self.journal.record(lambda: self.table.write(row, start, slots))

    def release(self, seq: Sequence, keep_kv: bool = True, hold_key=None) -> None:
        """Give up everything the attached sequence holds: its computed K/V to the tree (or to
        the pool when not `keep_kv`: K/V that produced non-finite logits must not be shared),
        its lock (kept under `hold_key` if given), its table row."""
        if keep_kv:
            self.cache_computed(seq)
            if hold_key is not None:
                self.hold(hold_key, seq.node)
        self.journal.touch(seq)
        row = seq.row
        self._keep_row(row, 0, self.table.read(row, 0, seq.num_computed).clone())
        self.free(self.private_slots(seq).clone())
        self.unlock(seq.node)
        self.table.free_row(row)
        self.journal.record(lambda: self.table.unfree_row(row))
        del self.attached[seq.seq_id]
        self.journal.record(lambda: self.attached.__setitem__(seq.seq_id, seq))
        seq.node, seq.row, seq.cached_len, seq.num_computed = None, -1, 0, 0

    def reset(self) -> None:
        """The pool is being dropped (sleep): forget the tree and every attachment."""
        self.cache.reset()
        self.attached.clear()
        self.holds.clear()
        self.pending = []
        self._runs = None

    # --- inspection -------------------------------------------------------------------------
    def private_slots(self, seq: Sequence) -> torch.Tensor:
        return self.table.read(seq.row, seq.cached_len, seq.num_computed)

    def check(self) -> None:
        """Assert the invariant above, the tree's own bookkeeping, and that each attached
        sequence's cached prefix is what the tree holds for its tokens."""
        if not self.pool.is_allocated:
            assert not self.attached and not self.pending, "sequences attached to a dropped pool"
            return
        parts = [self.pool.free_slots(), self.cache.all_slots(), *self.pending]
        parts += [self.private_slots(s) for s in self.attached.values()]
        every = torch.cat(parts).cpu().sort().values
        assert torch.equal(every, torch.arange(self.pool.num_slots)), \
            f"slot accounting broken: {every.numel()} slots accounted of {self.pool.num_slots}"
        self.cache.check()
        pins: Counter = Counter()
        for seq in self.attached.values():
            assert 0 <= seq.cached_len <= seq.num_computed < seq.num_tokens
            assert torch.equal(self.table.read(seq.row, 0, seq.cached_len),
                               self.cache.peek(seq.cache_key(seq.cached_len)))
        for node in [*(s.node for s in self.attached.values()), *self.holds.values()]:
            while node is not self.cache.root:
                pins[id(node)] += 1
                node = node.parent
        for node in self.cache.nodes():
            assert node.lock_ref == pins[id(node)], "radix lock count differs from its pins"
        rows = [s.row for s in self.attached.values()]
        assert len(set(rows)) == len(rows), "two sequences share a slot-table row"
        assert len(rows) + self.table.num_free_rows == self.table.shape[0], "table rows leaked"
