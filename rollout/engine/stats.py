"""Counters the engine keeps for users and benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# The parts of a step's time, as EngineStats fields (forward_seconds measured by the runner).
STEP_PHASES = ("schedule_seconds", "draft_seconds", "prepare_seconds", "forward_seconds",
               "sample_seconds", "commit_seconds")


def is_decode(item) -> bool:
    """A batch item (requests/batch.py ScheduledSeq) that feeds its sample's last token after
    its prompt: one position of its own, and the drafts it verifies."""
    return item.num_new - len(item.draft) == 1 and item.start >= item.seq.num_prompt


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # prompt tokens of every sample (n per prompt)
    prompt_tokens_computed: int = 0  # prompt positions actually run through the model
    # Tokens matched in the radix tree at admission: every admission's, a preempted or carried
    # sample's own tokens when it comes back included; prompt_hit_tokens: a sample's prompt
    # tokens matched at its first admission, what a prompt-cache hit rate divides by
    # prompt_tokens (score()'s sequences in neither this nor prompt_tokens).
    cache_hit_tokens: int = 0
    prompt_hit_tokens: int = 0
    generated_tokens: int = 0
    # Engine.score: tokens whose logprob it returned, and positions it ran through the model
    # (fewer when sequences share prefixes).
    scored_tokens: int = 0
    score_tokens_computed: int = 0
    # update_weights(probe=, probe_reference=): the last probe's largest |logprob gap| to the
    # trainer's (nan: no reference, or none probed yet)
    probe_gap: float = float("nan")
    # update_weights: how many completed, how many of them copied a LoRA adapter and not the
    # frozen base (rollout/lora/sync.py), and the last one's bytes and seconds.
    weight_syncs: int = 0
    adapter_syncs: int = 0
    weight_sync_bytes: int = 0
    weight_sync_seconds: float = 0.0
    steps: int = 0
    # steps that advanced at least one sample by a decode token (verifying drafts or not)
    decode_steps: int = 0
    preemptions: int = 0
    holds_dropped: int = 0  # multi-turn KV holds released under memory pressure
    # Partial rollouts (rollout/engine/carry.py): sequences running when sleep or
    # update_weights retracted them (their K/V re-prefilled on resumption, or parked), and
    # carried groups past max_staleness restarted from their prompts or dropped.
    retracted: int = 0
    stale_restarts: int = 0
    stale_drops: int = 0
    # EngineConfig(carried_kv="park"): tokens of K/V parked on the host through sleeps and
    # written back at wake-ups, the bytes parked now (0 awake), and samples that went on from
    # an older weights' K/V after an update.
    parked_tokens: int = 0
    parked_bytes: int = 0
    stale_kv_kept: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0  # inside the model forward (incl. logits)
    # EngineConfig(cuda_graphs=True): the model's decode graphs captured (a draft model's own are
    # not counted) and the seconds that took (part of forward_seconds). Sleep drops the graphs,
    # so every wake-up captures again those it uses.
    graph_captures: int = 0
    graph_capture_seconds: float = 0.0
    # The rest of a step, by phase: where the host spends what the forward does not use.
    schedule_seconds: float = 0.0  # admission, growth, preemption
    draft_seconds: float = 0.0  # speculative proposals
    prepare_seconds: float = 0.0  # the step's flat metadata
    sample_seconds: float = 0.0  # sampling or verification, tokens back to the host
    commit_seconds: float = 0.0  # appending tokens, stop checks, retiring, caching
    spec_proposed: int = 0  # draft tokens proposed (and verified)
    # Draft tokens accepted and kept: those a stop or the length cut off are not the sample's.
    spec_accepted: int = 0
    spec_verifications: int = 0  # sample-steps that verified drafts
    # Tokens those verifications gave the samples (accepted + 1 each, less any cut off).
    spec_emitted: int = 0
    # Per draft source ("ngram", "draft"; method "suffix": "self", "siblings", "history"):
    # [draft tokens proposed, accepted and kept].
    spec_sources: dict = field(default_factory=dict)
    # Decode steps that drafted, and those that did not for a batch above max_batch_size.
    spec_steps: int = 0
    spec_skipped_steps: int = 0
    # With speculation: the step cost adaptive drafting weighs drafts against (spec/cost.py),
    # seconds fixed and per position computed (nan until the engine's steps tell them apart).
    spec_step_fixed_seconds: float = float("nan")
    spec_position_seconds: float = float("nan")
    # Method "suffix": tokens its history holds, entries evicted under its budget.
    draft_history_tokens: int = 0
    draft_history_evicted: int = 0

    def record_step(self, batch, num_emitted: int, marks: tuple[float, ...]) -> None:
        """`marks`: perf_counter() at the start and after schedule, draft, prepare, forward,
        sample and commit."""
        start, scheduled, drafted, prepared, forwarded, sampled, committed = marks
        self.steps += 1
        self.generated_tokens += num_emitted
        self.step_seconds += committed - start
        self.schedule_seconds += scheduled - start
        self.draft_seconds += drafted - scheduled
        self.prepare_seconds += prepared - drafted
        self.sample_seconds += sampled - forwarded
        self.commit_seconds += committed - sampled
        if any(is_decode(it) for it in batch.items):
            self.decode_steps += 1

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.step_seconds if self.step_seconds else 0.0

    def record_verified(self, verified) -> None:
        """A step's verifications, as committed (Speculator.after_commit)."""
        for v in verified:
            self.spec_proposed += v.proposed
            self.spec_accepted += v.accepted
            self.spec_verifications += 1
            self.spec_emitted += v.emitted
            counts = self.spec_sources.setdefault(v.source, [0, 0])
            counts[0] += v.proposed
            counts[1] += v.accepted

    @property
    def acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    @property
    def tokens_per_verification(self) -> float:
        """Tokens a sample gains per target forward while speculating (0 when none was
        verified, as acceptance_rate is 0 when none was proposed)."""
        return self.spec_emitted / self.spec_verifications if self.spec_verifications else 0.0

    @property
    def overhead_share(self) -> float:
        """Share of step time spent outside the model forward (scheduling, metadata, sampling)."""
        return 1 - self.forward_seconds / self.step_seconds if self.step_seconds else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"tokens_per_second": self.tokens_per_second,
                               "overhead_share": self.overhead_share,
                               "acceptance_rate": self.acceptance_rate,
                               "tokens_per_verification": self.tokens_per_verification}
