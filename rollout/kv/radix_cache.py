"""Token-level radix tree over KV pool slots.

A node holds its edge's tokens (`key`; a branch from the root may begin with a (tag, token)
pair instead: see tag_branches) and the slots of their K/V (`value`), children keyed by
first token, a lock count and a last-access tick. `lock(node)` pins a node and all its
ancestors: a locked node is never evicted. Eviction frees unlocked leaves, least recently used
first, back to the pool.

Invariant: `evictable_size` + `protected_size` equals the number of slots in the tree;
`evictable_size` counts the slots of nodes whose lock count is 0. The tree never frees a slot:
evicted nodes go back to the caller (the KV manager), which owns the pool. `uninsert` and
`unevict` undo an insert and an eviction, for rolling a failed step back.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch


class RadixNode:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: RadixNode | None) -> None:
        self.key = key
        self.value = value
        self.children: dict[int, RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: RadixNode) -> bool:  # heap order for eviction
        return self.last_access < other.last_access


def common_prefix_len(key: Sequence[int], tokens: Sequence[int], start: int) -> int:
    n = min(len(key), len(tokens) - start)
    if list(key[:n]) == list(tokens[start:start + n]):
        return n
    i = 0
    while key[i] == tokens[start + i]:
        i += 1
    return i


class RadixCache:
    shares_prefixes = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        """Forget every node without freeing slots (the pool itself is being dropped)."""
        if hasattr(self, "root"):
            # Parent <-> child links make the old tree a reference cycle: its slot tensors
            # would stay allocated until the garbage collector ran. Break it now, so sleep()
            # hands the device memory back at once.
            for node in list(self.nodes()):
                node.parent, node.children, node.value = None, {}, None
        self.root = RadixNode([], self._empty(), None)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self._tick = 0

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _touch(self) -> int:
        self._tick += 1
        return self._tick

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # --- lookup -----------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> tuple[torch.Tensor, RadixNode]:
        """Slots of the longest cached prefix of `tokens` and the node that ends it.

        A match that ends inside an edge splits the edge, so the returned node covers exactly
        the matched prefix and can be locked on its own.
        """
        node, pos, pieces = self.root, 0, []
        now = self._touch()
        node.last_access = now
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = common_prefix_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pieces.append(child.value)
            node, pos = child, pos + n
        slots = torch.cat(pieces) if pieces else self._empty()
        return slots, node

    def peek(self, tokens: Sequence[int]) -> torch.Tensor:
        """Slots of the longest cached prefix, without splitting edges or touching LRU."""
        node, pos, pieces = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = common_prefix_len(child.key, tokens, pos)
            pieces.append(child.value[:n])
            pos += n
            if n < len(child.key):
                break
            node = child
        return torch.cat(pieces) if pieces else self._empty()

    def prefix_len(self, tokens: Sequence[int]) -> int:
        return self.peek(tokens).numel()

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut `node`'s edge after n tokens; returns the new upper half."""
        upper = RadixNode(node.key[:n], node.value[:n], node.parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        upper.children = {node.key[n]: node}
        node.parent.children[node.key[0]] = upper
        node.key, node.value, node.parent = node.key[n:], node.value[n:], upper
        return upper

    # --- insertion --------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int:
        """Cache `tokens` with their `slots`; returns how many leading tokens were already
        cached. The caller still owns `slots[:returned]` and must free those it allocated."""
        assert len(tokens) == slots.numel()
        node, pos, now = self.root, 0, self._touch()
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = RadixNode(list(tokens[pos:]), slots[pos:].clone(), node)
                leaf.last_access = now
                node.children[tokens[pos]] = leaf
                self.evictable_size += len(leaf.key)
                return pos
            n = common_prefix_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos

    # --- locks ------------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked radix node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    def uninsert(self, tokens: Sequence[int], already: int) -> None:
        """Undo `insert(tokens, ...)`, `already` being what it returned (or would have): drop
        the branch it added for tokens[already:], whatever splits happened since (it must be
        unlocked again). Safe on an insert that failed before adding anything."""
        node, pos = self.root, 0
        while pos < already:
            node = node.children.get(tokens[pos])
            if node is None:
                return
            pos += len(node.key)
        branch = node.children.get(tokens[already]) if pos == already < len(tokens) else None
        if branch is None:
            return  # the insert stopped before adding its branch
        del node.children[tokens[already]]
        stack = [branch]
        while stack:
            gone = stack.pop()
            assert gone.lock_ref == 0, "uninsert of a locked node"
            self.evictable_size -= len(gone.key)
            stack.extend(gone.children.values())

    # --- tags -------------------------------------------------------------------------------
    def tag_branches(self, tag: int) -> list[RadixNode]:
        """Key every branch from the root whose first token is a plain token id by (tag,
        token) instead: only keys tagged alike (Sequence.cache_key) reach it from then on.
        Returns the branches tagged, for untag_branches."""
        tagged = [n for n in self.root.children.values() if not isinstance(n.key[0], tuple)]
        for node in tagged:
            self._rekey(node, (tag, node.key[0]))
        return tagged

    def untag_branches(self, tagged: list[RadixNode]) -> None:
        """Undo tag_branches (its branches still hang from the root)."""
        for node in tagged:
            self._rekey(node, node.key[0][1])

    def _rekey(self, branch: RadixNode, first) -> None:
        del self.root.children[branch.key[0]]
        branch.key = [first, *branch.key[1:]]
        self.root.children[first] = branch

    # --- eviction ---------------------------------------------------------------------------
    def evict(self, num_slots: int) -> list[RadixNode]:
        """Detach unlocked leaves, LRU first, until they hold at least `num_slots` slots (fewer
        if the unlocked part of the tree is smaller). Returns them in eviction order; their
        slots are the caller's to free."""
        leaves = [n for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        evicted, freed = [], 0
        try:
            while freed < num_slots and leaves:
                leaf = heapq.heappop(leaves)
                evicted.append(leaf)
                freed += len(leaf.key)
                self.evictable_size -= len(leaf.key)
                parent = leaf.parent
                del parent.children[leaf.key[0]]
                if parent is not self.root and not parent.children and parent.lock_ref == 0:
                    heapq.heappush(leaves, parent)
        except BaseException:
            # All or nothing: the caller records its undo once it has the list, so nodes
            # detached before a failure here would be lost with their slots.
            self.unevict(evicted)
            raise
        return evicted

    def unevict(self, evicted: list[RadixNode]) -> None:
        """Put back what `evict` returned (their slots must hold the same K/V again)."""
        for node in reversed(evicted):
            node.parent.children[node.key[0]] = node
            self.evictable_size += len(node.key)

    # --- inspection -------------------------------------------------------------------------
    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_slots(self) -> torch.Tensor:
        pieces = [n.value for n in self.nodes()]
        return torch.cat(pieces) if pieces else self._empty()

    def check(self) -> None:
        """Assert the size bookkeeping and that lock counts never exceed the parent's."""
        evictable = protected = 0
        for node in self.nodes():
            assert len(node.key) == node.value.numel() > 0
            assert node.parent.children[node.key[0]] is node
            assert node.lock_ref >= 0
            if node.parent is not self.root:
                assert node.parent.lock_ref >= node.lock_ref
            if node.lock_ref == 0:
                evictable += len(node.key)
            else:
                protected += len(node.key)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), \
            ((evictable, protected), (self.evictable_size, self.protected_size))
