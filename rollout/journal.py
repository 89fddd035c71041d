"""The undo log that makes a step's bookkeeping transactional.

Inside `unit()`, every change to KV ownership (free list, radix tree, locks, slot-table rows)
and to the sequences and queues is recorded with its inverse. If anything is raised before the
unit ends (an error, a fault in a tokenizer, KeyboardInterrupt) the inverses run newest first
and the bookkeeping is exactly what it was when the unit began; sequences are restored from a
snapshot taken before their first change. Outside a unit nothing is recorded: the change is
final.

A unit never spans a forward pass. An undone eviction puts nodes back into the radix tree, which
is only right while their slots still hold the K/V they held: no forward may have written into
them in between (StepRunner.run (rollout/engine/step.py) cuts a step into units around its forwards for this reason).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class RollbackFailed(RuntimeError):
    """Undoing a failed unit raised in turn: the bookkeeping is in an unknown state."""


class Journal:
    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] | None = None
        self._seqs: dict[int, tuple] = {}  # id(seq) -> (seq, snapshot)

    @property
    def recording(self) -> bool:
        return self._undo is not None

    def record(self, undo: Callable[[], None]) -> None:
        """`undo` reverts a change just made; it must not read state that later changes of the
        unit could alter (capture what it needs when recorded)."""
        if self._undo is not None:
            self._undo.append(undo)

    def touch(self, seq) -> None:
        """Call before changing `seq`: its first change in a unit snapshots it."""
        if self._undo is not None and id(seq) not in self._seqs:
            self._seqs[id(seq)] = (seq, seq.snapshot())

    def add(self, obj, name: str, delta: int) -> None:
        """A counter that goes back with the unit."""
        old = getattr(obj, name)
        setattr(obj, name, old + delta)
        self.record(lambda: setattr(obj, name, old))

    def savepoint(self) -> int | None:
        """Where the unit's log stands (None outside a unit), for rollback_to."""
        return None if self._undo is None else len(self._undo)

    def rollback_to(self, point: int | None) -> bool:
        """Undo the unit's changes since `point` (newest first) and go on inside the unit;
        False outside one (nothing recorded: the changes stand). Only for changes that touch
        no sequence (their snapshots are the unit's, taken at its first change)."""
        if point is None or self._undo is None:
            return False
        undo = self._undo[point:]
        del self._undo[point:]
        try:
            for revert in reversed(undo):
                revert()
        except BaseException as e:
            # The rest of this segment is out of the log: the unit could not undo it either.
            raise RollbackFailed("undoing part of a unit") from e
        return True

    @contextlib.contextmanager
    def unit(self) -> Iterator[None]:
        """All of the block's bookkeeping changes, or none of them. Units do not nest: a block
        inside one joins it."""
        if self._undo is not None:
            yield
            return
        self._undo, self._seqs = [], {}
        try:
            yield
        except BaseException:
            undo, seqs = self._undo, self._seqs
            self._undo, self._seqs = None, {}
            try:
                for revert in reversed(undo):
                    revert()
                for seq, snapshot in seqs.values():
                    seq.restore(snapshot)
            except BaseException as e:
                raise RollbackFailed("undoing a failed unit") from e
            raise
        self._undo, self._seqs = None, {}
