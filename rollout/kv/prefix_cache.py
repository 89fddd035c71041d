"""The prefix cache the KV manager holds: what it asks of one (`PrefixCache`), the radix tree
that shares prefixes (radix_cache.py), and the cache of an engine with prefix caching off,
which holds nothing.

Both have one interface, so the KV manager runs the same code either way. With caching off
nothing matches, an insert takes no slot (the sequence keeps its K/V private until released,
then the pool gets it back), and there is never anything to evict.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from .radix_cache import RadixCache, RadixNode


class PrefixCache(Protocol):
    """Token prefixes -> the pool slots of their K/V. Every call is undone by its inverse
    (insert/uninsert, evict/unevict, lock/unlock), which is how the journal rolls it back."""

    shares_prefixes: bool
    evictable_size: int  # slots evict() can free (unlocked leaves and their ancestors)
    protected_size: int  # slots under a lock (a running sequence's prefix)
    total_size: int

    def reset(self) -> None: ...

    def match_prefix(self, tokens: Sequence[int]) -> tuple[torch.Tensor, RadixNode]: ...

    def peek(self, tokens: Sequence[int]) -> torch.Tensor: ...

    def prefix_len(self, tokens: Sequence[int]) -> int: ...

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int: ...

    def uninsert(self, tokens: Sequence[int], already: int) -> None: ...

    def lock(self, node: RadixNode) -> None: ...

    def unlock(self, node: RadixNode) -> None: ...

    def tag_branches(self, tag: int) -> list[RadixNode]: ...

    def untag_branches(self, tagged: list[RadixNode]) -> None: ...

    def evict(self, num_slots: int) -> list[RadixNode]: ...

    def unevict(self, evicted: list[RadixNode]) -> None: ...

    def nodes(self) -> Iterator[RadixNode]: ...

    def all_slots(self) -> torch.Tensor: ...

    def check(self) -> None: ...


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

    def tag_branches(self, tag: int) -> list[RadixNode]:
        return []

    def untag_branches(self, tagged: list[RadixNode]) -> None:
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


def make_prefix_cache(enabled: bool, device: torch.device) -> PrefixCache:
    return RadixCache(device) if enabled else NoPrefixCache(device)
