"""The engine's requests: those running, and those finished whose outputs are not handed out yet.

A request takes its id and its seed here, only once it is checked (rollout/requests/intake.py):
a refused request draws nothing, so it shifts no later request's seed. Every change is journaled
(rollout/journal.py) with the scheduler's, so a failed unit leaves both as they were.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ..journal import Journal
from ..requests.request import Request
from ..requests.sequence import Sequence
from ..sample.noise import sample_seed
from ..sample.params import SamplingParams


class RequestTable:
    def __init__(self, journal: Journal, seed: int | None) -> None:
        self.journal = journal
        self.running: dict[str, Request] = {}
        # Finished requests whose outputs are not handed out yet: generate() takes its own,
        # step() the rest (streaming requests that finished while generate() stepped).
        self.ready: dict[str, Request] = {}
        self._next_seq = self._next_request = 0
        self._seed_rng = random.Random(seed)
        # Told the sequences of every request that leaves the running set (the speculator's
        # per-sample state goes with them).
        self.forget: Callable[[list[Sequence]], None] | None = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.running or request_id in self.ready

    def make(self, text: str | None, ids: list[int], params: SamplingParams,
             request_id: str | None, eos_ids: frozenset[int], from_rollout: bool = False,
             reserved: frozenset[str] = frozenset()) -> Request:
        """Draws the request's id (unless given; never one of `reserved`, the ids its call
        gives its other requests) and seed: only for a checked request. `from_rollout`:
        Engine.rollout's (its output waits for a rollout() call). The draws are journaled: a
        unit that fails after them (an interrupt held while tokenizing, delivered before the
        request is queued) leaves the next request the ids and seed a fresh engine would give
        it."""
        drawn = (self._next_seq, self._next_request, self._seed_rng.getstate())
        self.journal.record(lambda: self._undraw(drawn))
        if request_id is None:
            request_id = self._new_request_id(reserved)
        # Greedy requests take no seed, so adding an evaluation does not shift later rollouts.
        if params.seed is not None or params.greedy:
            base = params.seed or 0
        else:
            base = self.draw_seed()
        stop_ids = params.stop_ids(eos_ids)
        first, self._next_seq = self._next_seq, self._next_seq + params.n
        seqs = [Sequence(seq_id=first + j, group=request_id, sample_index=j,
                         prompt_ids=ids, params=params, seed=sample_seed(base, j),
                         stop_ids=stop_ids) for j in range(params.n)]
        return Request(request_id, text, ids, params, seqs, from_rollout=from_rollout)

    @property
    def seed_draws(self) -> tuple:
        """Where the unseeded requests' seed stream stands (for give_back_seeds)."""
        return self._seed_rng.getstate()

    def give_back_seeds(self, draws: tuple) -> None:
        """The seeds drawn since `draws` go back to the stream: their requests were aborted
        unreturned (a failed generate), so the next ones draw what they would have. Ids are
        not given back: something may still name an aborted request or sequence."""
        self._seed_rng.setstate(draws)

    def _undraw(self, drawn) -> None:
        self._next_seq, self._next_request, state = drawn
        self._seed_rng.setstate(state)

    def draw_seed(self) -> int:
        """An unseeded request's seed, from the stream EngineConfig.seed starts (episodes'
        too: rollout/agent.py)."""
        return self._seed_rng.getrandbits(63)

    def _new_request_id(self, reserved: frozenset[str]) -> str:
        # A counter of its own, skipping the ids in use: callers may name requests "3" too.
        while True:
            request_id = str(self._next_request)
            self._next_request += 1
            if request_id not in self and request_id not in reserved:
                return request_id

    def start(self, request: Request) -> None:
        self.running[request.request_id] = request
        self.journal.record(lambda: self.running.pop(request.request_id))

    def end(self, request: Request, finished: bool = False) -> None:
        """The request leaves the running set; `finished` (its last sample finished): its
        output is kept in `ready` until handed out."""
        del self.running[request.request_id]
        self.journal.record(lambda: self.running.__setitem__(request.request_id, request))
        if finished:
            self.ready[request.request_id] = request
            self.journal.record(lambda rid=request.request_id: self.ready.pop(rid))
        if self.forget is not None:
            self.forget(request.seqs)

    def take_ready(self, request_id: str) -> Request | None:
        """The finished request's output leaves the table (journaled: a failed unit keeps it)."""
        request = self.ready.pop(request_id, None)
        if request is not None:
            self.journal.record(lambda: self.ready.__setitem__(request_id, request))
        return request

    def live_sequences(self) -> set[int]:
        return {s.seq_id for r in self.running.values() for s in r.seqs if not s.is_finished}
