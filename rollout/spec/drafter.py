"""What a drafter provides. The n-gram drafter holds no device state, so only `propose_batch`
is its own; the draft-model drafter overrides the rest (its pool sleeps with the engine, its
K/V rolls back after verification and after a failed step, its bookkeeping is checked with the
engine's)."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Drafter(ABC):
    @abstractmethod
    def propose_batch(self, wanted, siblings) -> list:
        """[(draft tokens, q [k, V] or None when deterministic)] per (sequence, k)."""

    def rollback(self, targets) -> None:
        """Drop state computed for proposals the target rejected."""

    def discard_pending(self) -> None:
        """A step failed: give back slots allocated for it and not yet committed."""

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def check_invariants(self) -> None:
        pass
