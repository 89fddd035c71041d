"""A request: one prompt, its n samples (`Sequence`s, sequence.py) and what its output needs."""

from __future__ import annotations

import dataclasses

from ..sample.params import SamplingParams
from .sequence import Sequence


@dataclasses.dataclass
class Request:
    """One prompt's request: its n sequences and what the output needs."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    error: str | None = None  # why the request was aborted by the engine
    # Engine.rollout's: its output goes to a rollout() call (carried until then), not step()
    from_rollout: bool = False
    # Engine.weights_version when its last sample finished (None until then)
    completed_version: int | None = None

    @property
    def done(self) -> bool:
        return all(s.is_finished for s in self.seqs)
