"""What a drafter provides. The n-gram drafter holds no device state, so only `propose_batch`
is its own. The draft-model drafter adds what its device state needs (its pool sleeps with the
engine, its K/V rolls back after verification and after a failed step, its memory is counted,
its bookkeeping is checked with the engine's); the suffix drafter (an n-gram drafter) what its
history of earlier samples needs (taking finished samples, forgetting them on request, its
bookkeeping checked likewise)."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Drafter(ABC):
    # Where each draft of the last propose_batch came from, when the drafter has several
    # sources (suffix.py); empty: the method's name says it.
    last_sources: list = []
    # The samples of earlier calls it drafts from (spec/history.py), if it keeps any.
    history = None
    # Each token it proposes costs a forward of its own (a draft model's): it is asked only for
    # the tokens that will be verified (Speculator._asked); the others' proposals are cut after.
    costly = False

    @abstractmethod
    def propose_batch(self, wanted, siblings) -> list:
        """[(draft tokens, q [k, V] or None when deterministic)] per (sequence, k)."""

    def flush(self) -> None:
        """Called first in every step's proposal, outside any journal unit."""

    def remember(self, seqs) -> None:
        """The samples of a request that left the engine (inside the unit that ended it)."""

    def clear(self) -> None:
        """Forget what earlier calls left (the history)."""

    def rollback(self, targets) -> None:
        """Drop state computed for proposals the target rejected."""

    def discard_pending(self) -> None:
        """A step failed: give back slots allocated for it and not yet committed."""

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def memory_held(self) -> int:
        """Device bytes it holds (the engine's memory_held counts them): none but a model's."""
        return 0

    def check_invariants(self) -> None:
        pass
