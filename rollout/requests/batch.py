"""One step's batch: which sequences run and which positions each computes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first token computed this step
    num_new: int  # tokens computed this step (drafts included)
    sample: bool  # the last new position's logits are sampled
    slots: torch.Tensor  # where the new tokens' K/V go
    # Proposals to verify after the last token (a shared empty tuple when none: a step builds
    # one item per sequence, and a list each would be garbage-collector work).
    draft: list[int] | tuple[()] = ()
    draft_probs: torch.Tensor | None = None  # q of each proposal; None: deterministic

    def input_ids(self) -> list[int]:
        own = self.seq.token_ids[self.start:self.start + self.num_new - len(self.draft)]
        return own + self.draft if self.draft else own  # a draft is a list (add_draft)

    def add_draft(self, draft: list[int], draft_probs: torch.Tensor | None,
                  slots: torch.Tensor) -> None:
        self.slots = torch.cat([self.slots, slots])
        self.num_new += len(draft)
        self.draft, self.draft_probs = draft, draft_probs


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
