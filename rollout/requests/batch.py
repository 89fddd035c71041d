"""One step's batch: which sequences run and which positions each computes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first token computed this step
    num_new: int  # tokens computed this step (drafts included)
    sample: bool  # the last new position's logits are sampled
    # Where the new tokens' K/V go (`slots`): this tensor, or, for a decode grown with the
    # step's others (Scheduler._grow_decodes), element `index` of their one tensor `shared`. A
    # view per item would cost ~0.5 us a sequence every step; few steps look at one.
    own_slots: torch.Tensor | None
    # Proposals to verify after the last token (a shared empty tuple when none: a step builds
    # one item per sequence, and a list each would be garbage-collector work).
    draft: list[int] | tuple[()] = ()
    draft_probs: torch.Tensor | None = None  # q of each proposal; None: deterministic
    shared: torch.Tensor | None = None
    index: int = 0

    @property
    def slots(self) -> torch.Tensor:
        if self.shared is None:
            return self.own_slots
        return self.shared[self.index:self.index + 1]

    def input_ids(self) -> list[int]:
        own = self.seq.token_ids[self.start:self.start + self.num_new - len(self.draft)]
        return own + self.draft if self.draft else own  # a draft is a list (add_draft)

    def add_draft(self, draft: list[int], draft_probs: torch.Tensor | None,
                  slots: torch.Tensor) -> None:
        self.own_slots, self.shared = torch.cat([self.slots, slots]), None
        self.num_new += len(draft)
        self.draft, self.draft_probs = draft, draft_probs


@dataclass
class Batch:
    items: list[ScheduledSeq]

    @property
    def out_slots(self) -> torch.Tensor:
        """Slots of the new tokens, item after item (consecutive elements of a shared tensor
        taken as one slice: a decode-only step's are that tensor). Read only: it may be the
        items' own slots."""
        parts, items, i = [], self.items, 0
        while i < len(items):
            it = items[i]
            if it.shared is None:
                parts.append(it.own_slots)
                i += 1
                continue
            j = i + 1
            while (j < len(items) and items[j].shared is it.shared
                   and items[j].index == it.index + j - i):
                j += 1
            parts.append(it.shared[it.index:it.index + j - i])
            i = j
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @property
    def num_tokens(self) -> int:
        return sum(it.num_new for it in self.items)
