"""The prefix cache of an engine with prefix caching off: it holds nothing.

It has the radix tree's interface, so the KV manager runs the same code either way: nothing
matches, an insert takes no slot (the sequence keeps its K/V private until released, then the
pool gets it back), and there is never anything to evict.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .radix_cache import RadixCache, RadixNode


class NoPrefixCache:
    shares_prefixes = False
    evictable_size = protected_size = total_size = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.root = RadixNode([], self._empty(), None)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def reset(self) -> None:
        pass

    def match_prefix(self, tokens: Sequence[int]) -> tuple[torch.Tensor, RadixNode]:
        return self._empty(), self.root

    def peek(self, tokens: Sequence[int]) -> torch.Tensor:
        return self._empty()

    def prefix_len(self, tokens: Sequence[int]) -> int:
        return 0

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int:
        return 0

    def uninsert(self, tokens: Sequence[int], already: int) -> None:
        pass

    def lock(self, node: RadixNode) -> None:
        pass

    def unlock(self, node: RadixNode) -> None:
        pass

    def evict(self, num_slots: int) -> list[RadixNode]:
        return []

    def unevict(self, evicted: list[RadixNode]) -> None:
        pass

    def nodes(self):
        return iter(())

    def all_slots(self) -> torch.Tensor:
        return self._empty()

    def check(self) -> None:
        pass


def make_prefix_cache(enabled: bool, device: torch.device) -> RadixCache | NoPrefixCache:
    return RadixCache(device) if enabled else NoPrefixCache(device)
