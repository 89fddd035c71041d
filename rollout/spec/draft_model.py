"""Draft-model drafting: a small model of the same tokenizer, with its own KV pool, radix cache
and slot table, proposes k tokens per sample by sampling k times.

The draft keeps a shadow `Sequence` per target sample. Each round it first computes whatever
the target emitted since its last round (the accepted drafts and the correction or bonus token,
in the same forward that yields its first proposal, so it never falls behind after a fully
accepted round), then decodes k - 1 more tokens. After verification `rollback` frees the K/V of
proposals the target rejected.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import EngineConfig
from ..executor.stack import ModelStack
from ..kv.radix_cache import common_prefix_len
from ..models.loader import build_model, load_into, resolve_model
from ..requests.batch import Batch, ScheduledSeq
from ..requests.sequence import SeqStatus, Sequence
from ..sample.noise import DRAFT_STREAM, TOKEN_STREAM
from ..sample.sampler import SamplingBatch, target_logprobs
from .drafter import Drafter


def check_shared_vocab(draft_vocab: int, target_vocab: int, tokenizer) -> None:
    """A draft shares the target's tokenizer: the same vocab_size, or sizes that differ past
    every id of the tokenizer (padding rows: Qwen2.5's 0.5B to 3B models have 151,936, its
    7B and larger 152,064, for one tokenizer of 151,665 ids), when the engine has it to tell."""
    if draft_vocab == target_vocab:
        return
    if tokenizer is not None and len(tokenizer) <= min(draft_vocab, target_vocab):
        return
    known = ("" if tokenizer is None else
             f", and the tokenizer's {len(tokenizer)} ids do not fit in both")
    raise ValueError(f"speculative.draft_model: vocab_size {draft_vocab} differs from the "
                     f"target's {target_vocab}{known}; it must share the tokenizer (sizes "
                     f"may differ only by padding past the ids of the engine's tokenizer)")


def build_draft_model(spec, config: EngineConfig, tokenizer, target_vocab: int,
                      dtype: torch.dtype, device: torch.device):
    """The draft model of SpeculativeConfig `spec` (None unless method "draft"), its
    vocabulary checked against the target's, built and loaded in the target's dtype on its
    device. The engine builds it before it sizes the target's KV pool: the memory the pool is
    sized from is then what the draft's weights left, and the draft's own pool (as many slots)
    is counted in each slot's bytes (executor/stack.py pool_slots)."""
    if spec is None or spec.method != "draft":
        return None
    hf_config, weights, _, _, _ = resolve_model(spec.draft_model, config, tokenizer,
                                                "speculative.draft_model")
    check_shared_vocab(hf_config.vocab_size, target_vocab, tokenizer)
    model = build_model(hf_config, config.max_model_len, dtype, device, source=spec.draft_model)
    load_into(model, weights)
    return model


class DraftModelDrafter(Drafter):
    costly = True

    def __init__(self, model, target: ModelStack, config: EngineConfig,
                 acceptance: str = "coupled") -> None:
        """`model`: build_draft_model's. `target`: the engine's model stack, whose vocabulary
        the draft shares, and whose journal its bookkeeping joins (a failed step rolls both
        back together). `acceptance` (SpeculativeConfig's) sets the noise the draft samples
        with, the target's own (TOKEN_STREAM) for "coupled", an independent one (DRAFT_STREAM)
        for "rejection", and whether its proposals carry their q: only the rejection rule reads
        it (verify.py)."""
        self.vocab, self.draft_vocab = target.model.vocab_size, model.vocab_size
        device = target.device
        # As many slots as the target: the draft tracks the same sequences.
        self.stack = ModelStack(model, config, target.pool.num_slots, device, target.kv.journal)
        self.kv, self.runner, self.journal = self.stack.kv, self.stack.runner, target.kv.journal
        self.sampler = self.stack.sampler
        self.device = device
        self.stream = TOKEN_STREAM if acceptance == "coupled" else DRAFT_STREAM
        self.keeps_q = acceptance == "rejection"
        # A draft forward computes at most a step's token budget: a new shadow's catch-up (its
        # prompt, less what the draft's tree holds) would otherwise be one unbounded prefill.
        self.max_batched_tokens = config.max_num_batched_tokens
        # seq_id -> (target, shadow, the target's token list when the shadow was made)
        self.shadows: dict[int, tuple[Sequence, Sequence, list[int]]] = {}

    # --- shadow bookkeeping -----------------------------------------------------------------
    @staticmethod
    def _restarted(entry) -> bool:
        """The target went back to its prompt (a stale group restarted, rollout/engine/
        carry.py): Sequence.restart gives it new token lists, and it may sample other tokens
        than those the shadow's cached prefix holds, which rollback cannot undo."""
        return entry[0].token_ids is not entry[2]

    def _forget_retired(self) -> None:
        """Shadows of targets no longer running, or restarted, go (a restarted one's shadow is
        made again from its tokens)."""
        for seq_id, entry in list(self.shadows.items()):
            if entry[0].status is not SeqStatus.RUNNING or self._restarted(entry):
                self._forget(seq_id)

    def _forget(self, seq_id: int) -> None:
        entry = self.shadows[seq_id]
        self.kv.release(entry[1])
        del self.shadows[seq_id]
        self.journal.record(lambda: self.shadows.__setitem__(seq_id, entry))

    def _shadow(self, target: Sequence) -> Sequence:
        entry = self.shadows.get(target.seq_id)
        if entry is not None:
            return entry[1]
        shadow = Sequence(seq_id=target.seq_id, group=target.group,
                          sample_index=target.sample_index, prompt_ids=target.prompt_ids,
                          params=target.params, seed=target.seed, stop_ids=frozenset(),
                          token_ids=list(self._readable(target.token_ids)))
        slots, node = self.kv.match(shadow.token_ids[:-1])
        self.kv.lock(node)
        self.kv.attach(shadow, slots, node)
        self.shadows[target.seq_id] = (target, shadow, target.token_ids)
        self.journal.record(lambda: self.shadows.pop(target.seq_id))
        return shadow

    def rollback(self, targets: list[Sequence]) -> None:
        """Free draft K/V past what the target kept (rejected proposals)."""
        for target in targets:
            entry = self.shadows.get(target.seq_id)
            if entry is None:
                continue
            shadow = entry[1]
            valid = min(common_prefix_len(shadow.token_ids[:shadow.num_computed],
                                          self._readable(target.token_ids), 0),
                        target.num_tokens - 1)
            self.kv.truncate(shadow, valid)
            self.journal.touch(shadow)
            shadow.token_ids = shadow.token_ids[:shadow.num_computed + 1]

    def discard_pending(self) -> None:
        self.kv.discard_pending()

    # --- vocabularies padded apart (check_shared_vocab) ----------------------------------------
    def _readable(self, tokens: list[int]) -> list[int]:
        """The target's tokens as the draft reads them (the list itself where its vocabulary
        holds them all): an id past the draft's vocabulary (a padding row of the target's,
        which it emits only by chance) as the draft's last id, which it can embed; drafts
        after it are merely rejected."""
        # One pass in C: a padding id is emitted only by chance, so the list is nearly always
        # readable as it is (mapping it in Python cost ~1.4 ms a call at 8k tokens).
        if self.vocab <= self.draft_vocab or max(tokens, default=-1) < self.draft_vocab:
            return tokens
        top = self.draft_vocab - 1
        return [min(t, top) for t in tokens]

    def _over_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary, the proposals' and q's: the draft's
        padding rows past it dropped, the target's past the draft's at -inf (never proposed)."""
        if self.draft_vocab == self.vocab:
            return logits
        if self.draft_vocab > self.vocab:
            return logits[:, :self.vocab].contiguous()
        return F.pad(logits, (0, self.vocab - self.draft_vocab), value=-math.inf)

    # --- colocation -------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the draft's KV pool; its weights go to host memory (the trainer never updates
        them, so they are parked rather than dropped, whatever the engine's level). The
        shadows let go of their K/V one by one first: a sleep failing before the pool is
        dropped leaves the draft awake and its bookkeeping whole (they are made again)."""
        for seq_id in list(self.shadows):
            self._forget(seq_id)
        self.stack.sleep(1)

    def wake_up(self) -> None:
        self.stack.wake_up()

    def memory_held(self) -> int:
        return self.stack.memory_held()  # its weights parked at level 2 too (sleep)

    def check_invariants(self) -> None:
        self.kv.check()
        assert set(self.shadows) == set(self.kv.attached), "draft shadows differ from its KV"
        # What the draft's tree holds of a shadow cannot be truncated: it must lie within the
        # target's tokens but the newest, whose K/V the target has yet to compute (a restarted
        # target's shadow is stale until the next proposal drops it).
        for entry in self.shadows.values():
            target, shadow, _ = entry
            assert self._restarted(entry) or shadow.cached_len < target.num_tokens, \
                "draft cache past the target's tokens"

    # --- proposing --------------------------------------------------------------------------
    def propose_batch(self, wanted: list[tuple[Sequence, int]], siblings):
        """[(draft tokens, q [k, V] under "rejection", else None)] per (target sequence, k)."""
        results: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        active: list[tuple[Sequence, Sequence, int]] = []
        with self.journal.unit():
            self._forget_retired()
            # A group's first shadow computes its prompt into the draft tree; its siblings
            # wait for that round, then all join at once (waiting on each other, one joined a
            # round: the last of 64 samples drafted from its 64th round).
            drafting = {shadow.group for _, shadow, _ in self.shadows.values()}
            new_groups: set[str] = set()
            for target, k in wanted:
                if target.seq_id not in self.shadows and target.group not in drafting:
                    if target.group in new_groups:
                        continue
                    new_groups.add(target.group)
                shadow = self._shadow(target)
                self.rollback([target])
                shadow.token_ids = list(self._readable(target.token_ids))
                active.append((target, shadow, k))
                results[target.seq_id] = ([], [])
        for step in range(max((k for _, _, k in active), default=0)):
            active = [(t, s, k) for t, s, k in active if k > step]
            active = self._draft_round(active, results)
        out = []
        for target, _ in wanted:
            tokens, probs = results.get(target.seq_id, ([], []))
            out.append((tokens, torch.stack(probs) if probs else None))
        return out

    def _draft_round(self, active, results):
        """One draft forward: each shadow computes its uncomputed tokens and samples one. The
        slots are taken in one unit and committed in another, with the forward between them
        (see rollout/journal.py); a failure in between leaves them pending, for the engine to
        discard. Within max_num_batched_tokens: a shadow whose catch-up does not fit computes
        what is left of the budget, samples nothing and drafts no more this step (it goes on
        from there at the next)."""
        items, kept, room = [], [], self.max_batched_tokens
        with self.journal.unit():
            for target, shadow, k in active:
                n = min(shadow.num_tokens - shadow.num_computed, room)
                slots = self.kv.alloc(n) if n else None
                if slots is None:  # no budget or draft pool left: no more drafts for this one
                    continue
                self.kv.place(shadow, shadow.num_computed, slots)
                sample = n == shadow.num_tokens - shadow.num_computed
                items.append(ScheduledSeq(shadow, shadow.num_computed, n, sample, slots))
                room -= n
                if sample:
                    kept.append((target, shadow, k))
        if not items:
            return []
        logits, _ = self.runner.run(self.runner.prepare(Batch(items)))
        rows = SamplingBatch.for_sequences([(s, 0) for _, s, _ in kept], self.device)
        drawn = iter(zip(*self._sample(logits, rows)) if kept else ())
        with self.journal.unit():
            for it in items:
                shadow = it.seq
                self.kv.advance(shadow, it.num_new)
                if it.start < shadow.num_prompt - 1:
                    # The prompt but its last token, for the siblings: what the shadow computed
                    # past it stays private, so rollback can always go back to the target's
                    # tokens, even to a target that has sampled nothing yet (its prompt cached
                    # in the engine's tree: it decodes, and drafts, from its first step) whose
                    # step then failed.
                    self.kv.cache_computed(shadow, shadow.num_prompt - 1)
                if not it.sample:
                    continue
                token, q_row = next(drawn)
                shadow.token_ids.append(token)
                drafted, probs = results[shadow.seq_id]
                drafted.append(token)
                if q_row is not None:
                    probs.append(q_row)
            self.kv.settle()
        return kept

    def _sample(self, logits: torch.Tensor, rows: SamplingBatch) -> tuple[list[int], list]:
        """Draft tokens, each with the q it was drawn from (the filtered draft distribution)
        where the acceptance reads it ("rejection"), else None: coupled acceptance never does,
        and the q rows were k x V floats a drafting sample (1.2 GB a step at 256 samples,
        k = 8 and a 152k vocabulary)."""
        logits = self._over_target_vocab(logits)
        _, candidates = target_logprobs(logits, rows)
        tokens = self.sampler.pick(logits, candidates, rows, self.stream).tolist()
        return tokens, candidates.softmax(dim=-1) if self.keeps_q else [None] * len(tokens)
