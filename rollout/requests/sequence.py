"""One sample's state: its tokens, parameters, KV bookkeeping and status.

A prompt with `n` samples becomes n `Sequence`s sharing a `group` (the request id). Tokens
`token_ids[:num_computed]` have K/V in the pool; the slots of the first `cached_len` of them
belong to the radix tree (pinned by locking `node`), the rest are the sequence's private tail.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..kv.radix_cache import RadixNode
from ..sample.params import SamplingParams
from ..score.state import ScoreState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    group: str
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # int32 noise seed of this sample
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and the stop_token_ids
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # SamplingParams.logprobs: each token's log-probability under the truncated distribution it
    # was drawn from; return_support: that distribution's kept ids (None: the whole vocabulary)
    sampling_logprobs: list[float] = field(default_factory=list)
    support: list = field(default_factory=list)
    # SamplingParams.top_logprobs: per output token, (ids, logprobs) of its alternatives
    top_logprobs: list = field(default_factory=list)
    # Engine.weights_version of the output tokens, as runs: (index of the run's first output
    # token, version). One run unless the sample was carried across update_weights
    # (rollout/engine/carry.py).
    versions: list[tuple[int, int]] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    cached_len: int = 0
    node: RadixNode | None = None
    row: int = -1  # row of the slot table while running
    finish_reason: str | None = None
    stop_text_at: int | None = None  # where a matched stop string starts in the output text
    # return_routed_experts: (routes, their rows' weights versions), read from the KV pool when
    # the sample finishes (commit.py)
    routed_experts: tuple[torch.Tensor, torch.Tensor] | None = None
    # return_routed_experts with carried_kv="recompute": the (routes, versions) its cached K/V
    # held before each weight update it was carried across (Carry.keep_routes), oldest first;
    # a tuple, replaced whole, so that the journal's snapshot keeps the old one.
    earlier_routes: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    # Multi-turn: keep this sample's KV locked under `hold_key` when it finishes; release the
    # hold `resume_key` (the previous turn's) once this one is admitted on top of it.
    hold_key: object = None
    resume_key: object = None
    # Engine.score's sequences (rollout/score/state.py): prefilled, scored row by row, never
    # sampled; None for a sample.
    score: ScoreState | None = None
    # EngineConfig(carried_kv="park"): carried across a weight update, the sample goes on from
    # K/V the old weights computed; its prefix-cache keys carry this tag (cache_key), so that
    # only samples tagged alike share that K/V and no fresh request matches it. None: its K/V
    # is the current weights'.
    kv_tag: int | None = None
    # With a tag, the positions from which its K/V was computed under later weights, as
    # (position, the tag those weights' K/V would take: KVManager.kv_label) in order; its keys
    # mark them too, so that K/V of alike tokens is shared only where every position came from
    # the same weights (a sample one token behind an identical sibling at an update computes
    # that token's K/V under the new weights, the sibling had it from the old ones).
    kv_bounds: tuple[tuple[int, int], ...] = ()
    # Admitted once: its prompt's match in the radix tree is counted then only as a prompt hit
    # (a re-admission after a preemption, retraction or restart matches its own tokens again).
    admitted: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    def snapshot(self) -> tuple:
        """State to restore if a step's bookkeeping is undone (rollout/journal.py). Token and
        logprob lists are only appended to, or replaced, while a snapshot is held, so their
        objects and lengths are enough."""
        lists = self._lists()
        return (self.status, self.num_computed, self.cached_len, self.node, self.row,
                self.finish_reason, self.stop_text_at, self.routed_experts, self.earlier_routes,
                self.kv_tag, self.kv_bounds, *lists, *map(len, lists))

    def restore(self, snapshot: tuple) -> None:
        (self.status, self.num_computed, self.cached_len, self.node, self.row,
         self.finish_reason, self.stop_text_at, self.routed_experts, self.earlier_routes,
         self.kv_tag, self.kv_bounds, self.token_ids, self.logprobs, self.sampling_logprobs,
         self.support, self.top_logprobs, self.versions, *lengths) = snapshot
        for values, length in zip(self._lists(), lengths):
            del values[length:]

    def _lists(self) -> tuple[list, ...]:
        """The per-token lists, appended to as the sample grows."""
        return (self.token_ids, self.logprobs, self.sampling_logprobs, self.support,
                self.top_logprobs, self.versions)

    def stamp(self, version: int) -> None:
        """The output tokens appended next were sampled under weights `version`."""
        if not self.versions or self.versions[-1][1] != version:
            self.versions.append((self.num_output, version))

    def token_versions(self) -> list[int]:
        """The weights version of each output token."""
        bounds = [first for first, _ in self.versions[1:]] + [self.num_output]
        return [v for (first, v), end in zip(self.versions, bounds) for _ in range(end - first)]

    @property
    def oldest_version(self) -> int | None:
        """The version of the first output token (None before any)."""
        return self.versions[0][1] if self.versions else None

    def restart(self) -> None:
        """Back to the prompt, waiting: every output token, logprob, version and route is gone
        (new lists, so a journal snapshot keeps the old ones whole; the draft model tells a
        restarted target by its new token list, rollout/spec/draft_model.py)."""
        self.token_ids = list(self.prompt_ids)
        self.logprobs, self.sampling_logprobs, self.support = [], [], []
        self.top_logprobs, self.versions = [], []
        self.status, self.finish_reason, self.stop_text_at = SeqStatus.WAITING, None, None
        self.routed_experts, self.kv_tag, self.kv_bounds = None, None, ()
        self.earlier_routes = ()

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def is_prefilling(self) -> bool:
        """More than the one newest token still lacks K/V (a scored sequence: any token)."""
        return self.num_computed < self.num_tokens - (self.score is None)

    def reusable_tokens(self) -> list:
        """The key (cache_key) of the tokens whose K/V admission may take from the prefix
        cache: all but the newest, whose logits give the next sample; a scored sequence's
        below its first unknown row (a cache hit skips the forward that would compute the rows
        it covers)."""
        return self.cache_key(self.num_tokens - 1 if self.score is None else self.score.filled)

    def cache_key(self, end: int) -> list:
        """The prefix cache's key of token_ids[:end]: the tokens, the first one paired with
        `kv_tag` when the sample goes on from stale K/V, and the first of each later weights'
        positions with their label (kv_bounds)."""
        key = self.token_ids[:end]
        if self.kv_tag is not None and key:
            key[0] = (self.kv_tag, key[0])
        for at, label in self.kv_bounds:
            if at >= end:
                break
            key[at] = (label, key[at])
        return key

    @property
    def prompt_kv(self) -> tuple | None:
        """What tells apart the prompt K/V this sample reads from its siblings' (None: the
        current weights', which fresh siblings share): its tag and the labels of its prompt's
        later weights' positions (a tagged prompt whose end was evicted and computed again
        under other weights than a sibling's)."""
        if self.kv_tag is None:
            return None
        return (self.kv_tag, *(b for b in self.kv_bounds if b[0] < self.num_prompt))

    def computes_from(self, start: int, label: int) -> None:
        """Positions start.. get their K/V now (admission matched the ones before), under the
        weights labelled `label` (KVManager.kv_label); from 0 the sample's K/V is all the
        current weights', as a fresh one's. No label where the K/V before `start` came from
        the same weights: identical histories keep one key, and share."""
        if start == 0:
            self.kv_tag, self.kv_bounds = None, ()
            return
        bounds = tuple(b for b in self.kv_bounds if b[0] < start)
        before = bounds[-1][1] if bounds else self.kv_tag
        if before is not None and before != label:
            bounds += ((start, label),)
        self.kv_bounds = bounds

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
