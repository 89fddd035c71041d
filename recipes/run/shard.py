"""Which prompts each engine rolls out: each epoch is one shuffle of the rows from a shared seed,
and each engine takes its own slice of it, so no two engines draw one row in the same epoch and
no communication is needed, however many prompts each draws a step (partial rollouts and dynamic
sampling draw as many as their carried and dropped groups leave room for, which differs
between engines; an engine an epoch ahead of another may draw a row the other has still to
draw in the earlier epoch).

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
        if num_rows < engines:
            raise ValueError(f"training set: {num_rows} rows for {engines} engines; each "
                             f"engine needs rows of its own")
        self.num_rows, self.per_engine = num_rows, per_engine
        self.engine, self.engines, self.seed = engine, engines, seed
        self.epoch = 0
        self.order: list[int] = []  # this engine's rows still to draw

    def next(self, count: int | None = None) -> list[int]:
        """This engine's row indices (`count` of them; default per_engine); epochs reshuffle,
        no row repeats within one, on one engine or across engines."""
        need = self.per_engine if count is None else count
        while len(self.order) < need:
            # Every rank shuffles epoch e alike (the seed and e alone decide it), whenever
            # its engine gets there.
            rows = list(range(self.num_rows))
            random.Random(f"{self.seed}:{self.epoch}").shuffle(rows)
            self.order += rows[self.engine::self.engines]
            self.epoch += 1
        batch, self.order = self.order[:need], self.order[need:]
        return batch


def rank_slice(items: list, rank: int, world: int) -> list:
    return items[rank::world]
