"""Which prompts each process rolls out: every rank draws the same global batch from a shared
seed and keeps its own slice, so ranks never overlap and no communication is needed."""

from __future__ import annotations

import random


class PromptSampler:
    def __init__(self, num_rows: int, per_rank: int, rank: int, world: int, seed: int) -> None:
        self.num_rows, self.per_rank, self.rank, self.world = num_rows, per_rank, rank, world
        self.rng = random.Random(seed)  # same seed on every rank: the same global order
        self.order: list[int] = []

    def next(self) -> list[int]:
        """This rank's row indices for one step; epochs reshuffle, no row repeats within one."""
        need = self.per_rank * self.world
        while len(self.order) < need:
            epoch = list(range(self.num_rows))
            self.rng.shuffle(epoch)
            self.order += epoch
        batch, self.order = self.order[:need], self.order[need:]
        return batch[self.rank::self.world]


def rank_slice(items: list, rank: int, world: int) -> list:
    return items[rank::world]
