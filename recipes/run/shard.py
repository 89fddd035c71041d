"""Which prompts each engine rolls out: every rank draws the same global batch from a shared
seed and keeps its engine's slice, so engines never overlap and no communication is needed.

With `tensor_parallel_size` k, W processes run W / k engines of k consecutive ranks
(rollout/parallel/group.py builds them so): the data is sharded across engines, and the k ranks
of one engine take the same slice, since they must run the same requests."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSlot:
    index: int  # which engine this process is a rank of
    count: int  # engines in the world
    tp_rank: int  # this process's rank within its engine


def engine_slot(process_index: int, num_processes: int, tensor_parallel_size: int) -> EngineSlot:
    return EngineSlot(process_index // tensor_parallel_size,
                      num_processes // tensor_parallel_size,
                      process_index % tensor_parallel_size)


class PromptSampler:
    def __init__(self, num_rows: int, per_engine: int, engine: int, engines: int,
                 seed: int) -> None:
        self.num_rows, self.per_engine = num_rows, per_engine
        self.engine, self.engines = engine, engines
        self.rng = random.Random(seed)  # same seed on every rank: the same global order
        self.order: list[int] = []

    def next(self, count: int | None = None) -> list[int]:
        """This engine's row indices for one step (`count` of them; default per_engine);
        epochs reshuffle, no row repeats within one."""
        need = (self.per_engine if count is None else count) * self.engines
        while len(self.order) < need:
            epoch = list(range(self.num_rows))
            self.rng.shuffle(epoch)
            self.order += epoch
        batch, self.order = self.order[:need], self.order[need:]
        return batch[self.engine::self.engines]


def rank_slice(items: list, rank: int, world: int) -> list:
    return items[rank::world]
