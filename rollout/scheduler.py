"""Every step: admit waiting sequences, chunk prefills, grow decodes, preempt, retire.

Decodes go first, then prefill chunks of running sequences, then admissions, all within
`max_num_batched_tokens`. Admission matches a sequence's tokens (all but the last, whose logits
give the next sample) in the radix tree, locks the matched node and allocates slots for the
unmatched part only. A sequence whose prompt shares most of its unmatched part with a prompt
another running sequence is still prefilling waits one round: that prefill is about to be
cached, and re-admission then computes only what is new (n samples, repeated prompts, shared
system prefixes all prefill their common tokens once).

When growth finds no slot even after evicting unlocked leaves, the newest running sequence is
preempted: its computed tokens go into the tree, it unlocks, and it rejoins the front of the
queue, where re-admission hits the cache.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import EngineConfig
from .kv_pool import KVPool
from .radix_cache import RadixCache, common_prefix_len
from .request import SeqStatus, Sequence
from .slot_table import SlotTable


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first token computed this step
    num_new: int  # tokens computed this step (drafts included)
    sample: bool  # the last new position's logits are sampled
    slots: torch.Tensor  # where the new tokens' K/V go
    draft: list[int] = field(default_factory=list)  # proposals to verify after the last token
    draft_probs: torch.Tensor | None = None  # q of each proposal; None: deterministic

    def input_ids(self) -> list[int]:
        own = self.num_new - len(self.draft)
        return self.seq.token_ids[self.start:self.start + own] + self.draft


@dataclass
class Batch:
    items: list[ScheduledSeq]

    @property
    def out_slots(self) -> torch.Tensor:
        """Slots of the new tokens, item after item."""
        return torch.cat([it.slots for it in self.items])

    @property
    def num_tokens(self) -> int:
        return sum(it.num_new for it in self.items)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, cache: RadixCache,
                 table: SlotTable) -> None:
        self.config, self.pool, self.cache, self.table = config, pool, cache, table
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.cache_hit_tokens = 0  # tokens matched in the tree at admission
        self.prompt_tokens_computed = 0  # prompt positions actually run through the model

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling -------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        budget = self.config.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        preempted = False
        scheduled: set[int] = set()
        decodes = [s for s in self.running if not s.is_prefilling]
        grown = self._grow_decodes(decodes[:budget], items)
        scheduled.update(s.seq_id for s in decodes[:grown])
        budget -= grown
        order = decodes[grown:] + [s for s in self.running if s.is_prefilling]
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed, budget)
            slots = self.alloc_slots(n)
            while slots is None:
                victim = self._newest_unscheduled(scheduled)
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
                slots = self.alloc_slots(n)
            if slots is None:
                continue
            scheduled.add(seq.seq_id)
            self.schedule_seq(seq, slots, items)
            budget -= n
        if not preempted:
            budget = self._admit(budget, items)
        if not items:
            return None
        return Batch(items)

    def _grow_decodes(self, decodes: list[Sequence], items: list[ScheduledSeq]) -> int:
        """One slot for each decoding sequence, allocated and written to the table with a
        constant number of device ops (per-sequence ops would make a GPU step launch-bound).
        Returns how many were scheduled: all, or none when the pool is short, and then the
        one-by-one path decides whom to preempt."""
        slots = self.alloc_slots(len(decodes)) if decodes else None
        if slots is None:
            return 0
        self.table.write_each([s.row for s in decodes], [s.num_computed for s in decodes], slots)
        items.extend(ScheduledSeq(seq, seq.num_computed, 1, True, slots[i:i + 1])
                     for i, seq in enumerate(decodes))
        return len(decodes)

    def schedule_seq(self, seq: Sequence, slots: torch.Tensor,
                     items: list[ScheduledSeq]) -> None:
        n = slots.numel()
        self.table.write(seq.row, seq.num_computed, slots)
        items.append(ScheduledSeq(seq, seq.num_computed, n,
                                  seq.num_computed + n == seq.num_tokens, slots))

    def add_drafts(self, item: ScheduledSeq, draft: list[int],
                   draft_probs: torch.Tensor | None) -> bool:
        """Extend a decode item with proposals to verify; False (item unchanged) when the
        pool has no room for them even after eviction: drafts never preempt anyone."""
        slots = self.alloc_slots(len(draft))
        if slots is None:
            return False
        self.table.write(item.seq.row, item.start + item.num_new, slots)
        item.slots = torch.cat([item.slots, slots])
        item.num_new += len(draft)
        item.draft, item.draft_probs = draft, draft_probs
        return True

    def _newest_unscheduled(self, scheduled: set[int]) -> Sequence:
        for seq in reversed(self.running):
            if seq.seq_id not in scheduled:
                return seq
        raise RuntimeError("KV pool exhausted by sequences already scheduled this step")

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        short = n - self.pool.num_free
        if short > 0:
            self.cache.evict(short)
        if n > self.pool.num_free:
            return None
        return self.pool.alloc(n)

    # --- admission --------------------------------------------------------------------------
    def _admission_order(self) -> list[Sequence]:
        waiting = list(self.waiting)
        if (self.config.schedule_policy == "lpm" and self.cache.enabled
                and len(waiting) <= self.config.lpm_max_waiting):
            waiting.sort(key=lambda s: -self.cache.prefix_len(s.token_ids[:-1]))
        return waiting

    def _admit(self, budget: int, items: list[ScheduledSeq]) -> int:
        admitted: set[int] = set()
        # Prompts being prefilled now, by group; their prefixes are cached once computed. A
        # sample that only computes its last prompt token (the rest matched) shares nothing.
        in_flight = {s.group: s for s in self.running if s.num_computed < s.num_prompt - 1}
        decode_reserve = len(self.running)
        for seq in self._admission_order():
            if (budget == 0 or len(self.running) >= self.config.max_num_seqs
                    or self.table.num_free_rows == 0):
                break
            if self.cache.enabled and seq.group in in_flight:
                continue
            slots, node = self.cache.match_prefix(seq.token_ids[:-1])
            matched = slots.numel()
            if self.cache.enabled and self._waits_for(seq, matched, in_flight):
                continue
            n = min(seq.num_tokens - matched, budget)
            self.cache.lock(node)
            # Leave every running sequence room for its next decode token, or admission
            # would only buy an immediate preemption.
            if self.pool.num_free + self.cache.evictable_size < n + decode_reserve:
                self.cache.unlock(node)
                break
            new = self.alloc_slots(n)
            self.attach(seq, slots, node)
            admitted.add(seq.seq_id)
            self.schedule_seq(seq, new, items)
            budget -= n
            decode_reserve += 1
            if seq.num_computed < seq.num_prompt - 1:
                in_flight.setdefault(seq.group, seq)
        if admitted:
            self.waiting = deque(s for s in self.waiting if s.seq_id not in admitted)
        return budget

    def attach(self, seq: Sequence, slots: torch.Tensor, node) -> None:
        """Make `seq` running on top of its matched prefix (`slots`, ending at the locked
        `node`): it gets a table row and computes from there."""
        matched = slots.numel()
        seq.row = self.table.alloc_row()
        self.table.write(seq.row, 0, slots)
        seq.node, seq.cached_len, seq.num_computed = node, matched, matched
        self.cache_hit_tokens += matched
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    @staticmethod
    def _waits_for(seq: Sequence, matched: int, in_flight: dict[str, Sequence]) -> bool:
        """True when a prompt being prefilled covers at least half of what `seq` would compute."""
        todo = seq.num_tokens - 1 - matched
        if todo <= 0:
            return False
        tokens = seq.token_ids
        for other in in_flight.values():
            if other.prompt_ids[0] != tokens[0]:
                continue
            shared = common_prefix_len(other.prompt_ids, tokens[:-1], 0)
            if 2 * (shared - matched) >= todo:
                return True
        return False

    # --- after the forward ---------------------------------------------------------------------
    def commit(self, batch: Batch, emitted: list[list[int]], logprobs: list[list[float]],
               stop: Callable[[Sequence], str | None]) -> list[Sequence]:
        """Advance every scheduled sequence by what it kept, append its emitted tokens (one, or
        accepted drafts plus one when verifying), return rejected slots, retire the finished."""
        finished = []
        sampled = iter(zip(emitted, logprobs))
        for it in batch.items:
            seq = it.seq
            self.prompt_tokens_computed += max(0, min(it.start + it.num_new, seq.num_prompt)
                                               - it.start)
            if not it.sample:
                seq.num_computed += it.num_new
                continue
            tokens, lps = next(sampled)
            kept = it.num_new - len(it.draft) + len(tokens) - 1  # rejected drafts drop out
            seq.num_computed += kept
            if kept < it.num_new:
                self.pool.free(it.slots[kept:])
            reason = None
            for token, logprob in zip(tokens, lps):
                seq.token_ids.append(token)
                if seq.params.logprobs:
                    seq.logprobs.append(logprob)
                reason = stop(seq)
                if reason is not None:
                    break
            self._trim_to_tokens(seq)
            if it.start < seq.num_prompt and self.cache.enabled:
                self.cache_computed(seq)  # the prompt is complete: siblings can share it now
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _trim_to_tokens(self, seq: Sequence) -> None:
        """A stop inside accepted drafts leaves K/V past the last kept token: free it."""
        self.truncate(seq, seq.num_tokens - 1)

    def truncate(self, seq: Sequence, num_computed: int) -> None:
        """Drop the K/V of positions >= num_computed (never below what the tree holds)."""
        num_computed = max(num_computed, seq.cached_len)
        if num_computed < seq.num_computed:
            self.pool.free(self.table.read(seq.row, num_computed, seq.num_computed).clone())
            seq.num_computed = num_computed

    def undo(self, batch: Batch) -> None:
        """Return a step's new slots: nothing was committed, so the next step redoes it."""
        self.pool.free(batch.out_slots)

    # --- retiring ---------------------------------------------------------------------------
    def cache_computed(self, seq: Sequence) -> None:
        """Hand the sequence's computed tokens to the tree and lock the node that ends them;
        private slots that duplicate tokens already cached are freed and replaced."""
        end = seq.num_computed
        if end == seq.cached_len:
            return
        tokens = seq.token_ids[:end]
        slots = self.table.read(seq.row, 0, end)
        already = self.cache.insert(tokens, slots)
        self.pool.free(slots[seq.cached_len:already].clone())
        cached, node = self.cache.match_prefix(tokens)
        self.table.write(seq.row, 0, cached)
        self.cache.lock(node)
        self.cache.unlock(seq.node)
        seq.node, seq.cached_len = node, end

    def release(self, seq: Sequence, keep_kv: bool = True) -> None:
        """Give up everything the running sequence holds: its KV to the tree (or the pool when
        caching is off, or when `keep_kv` is False: K/V that produced non-finite logits must
        not be shared with later requests), its lock, its table row."""
        if self.cache.enabled:
            if keep_kv:
                self.cache_computed(seq)
            else:
                self.pool.free(self.private_slots(seq).clone())
            self.cache.unlock(seq.node)
        else:
            self.pool.free(self.table.read(seq.row, 0, seq.num_computed).clone())
        self.table.free_row(seq.row)
        self.running.remove(seq)
        seq.node, seq.row, seq.cached_len, seq.num_computed = None, -1, 0, 0

    def preempt(self, seq: Sequence) -> None:
        self.release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, keep_kv: bool = True) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.release(seq, keep_kv)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    # --- inspection -------------------------------------------------------------------------
    def private_slots(self, seq: Sequence) -> torch.Tensor:
        return self.table.read(seq.row, seq.cached_len, seq.num_computed)

    def check_invariants(self) -> None:
        """Assert: every slot is in exactly one of the free list, the tree, one running
        sequence's private tail; each node's lock count equals the sequences pinning it;
        each sequence's cached prefix is what the tree holds for its tokens."""
        parts = [self.pool.free_slots(), self.cache.all_slots()]
        parts += [self.private_slots(s) for s in self.running]
        every = torch.cat(parts).cpu().sort().values
        assert torch.equal(every, torch.arange(self.pool.num_slots)), \
            f"slot accounting broken: {every.numel()} slots accounted of {self.pool.num_slots}"
        self.cache.check()
        pins: Counter = Counter()
        for seq in self.running:
            assert seq.status is SeqStatus.RUNNING and 0 <= seq.num_computed < seq.num_tokens
            assert seq.cached_len <= seq.num_computed
            assert torch.equal(self.table.read(seq.row, 0, seq.cached_len),
                               self.cache.peek(seq.token_ids[:seq.cached_len]))
            node = seq.node
            while node is not self.cache.root:
                pins[id(node)] += 1
                node = node.parent
        for node in self.cache.nodes():
            assert node.lock_ref == pins[id(node)], "radix lock count differs from its pins"
        rows = [s.row for s in self.running]
        assert len(set(rows)) == len(rows), "two sequences share a slot-table row"
