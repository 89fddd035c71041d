"""Engine.score's body: the logprob of every token of given sequences, through the engine's
paged KV, prefix cache and batching. The call runs in rounds (rollout/score/plan.py): a
sequence sharing a long prefix with another waits for it and copies the shared rows; each
round is a batch of scored requests stepped like generate()'s."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from ..fields import as_float
from ..requests.intake import token_ids
from ..requests.request import Request
from ..sample.params import SamplingParams
from ..score.intake import check_scores
from ..score.plan import ScorePlan
from ..score.state import ScoreOutput, ScoreState, TopLogprobs


def score(engine, sequences, temperature: float, top_logprobs: int, start, use_tqdm: bool
          ) -> list[ScoreOutput]:
    def check():  # once, whatever rounds follow (none for no sequence)
        checked = check_scores(sequences, temperature, top_logprobs, start, engine.vocab_size,
                               engine.config.max_model_len, engine.tokenizer)
        ids, starts, temp, top = checked
        return [(None, t, (temp, top, first)) for t, first in zip(ids, starts)], [], checked
    _, (ids, starts, temperature, top) = engine._checked_alike(check)
    plan = ScorePlan(ids, starts, top)
    errors: dict[int, str] = {}
    while not plan.finished:
        chosen = plan.next_round()
        requests: list[Request] = []
        ready = engine.requests.ready
        try:
            _queue(engine, [(ids[i], prefix) for i, prefix in chosen], temperature, top,
                   requests)
            engine._step_until(lambda: sum(r.request_id in ready for r in requests),
                               len(requests), use_tqdm, "sequence")
            for (i, _), request in zip(chosen, requests):
                ready.pop(request.request_id)
                if request.error is not None:
                    errors[i] = request.error  # no source for the rows of others
                else:
                    plan.finish(i, request.seqs[0].score.rows())
        except BaseException as e:
            # Nobody else collects these: running ones are aborted, finished ones dropped.
            engine.carry.abandon([r.request_id for r in requests], e)
            raise
    outputs = []
    for i, (tokens, first) in enumerate(zip(ids, starts)):
        if i in errors:
            outputs.append(ScoreOutput(tokens, first, None, error=errors[i]))
            continue
        rows = plan.results[i][first - 1:]
        outputs.append(ScoreOutput(tokens, first, rows.logprobs.tolist(),
                                   TopLogprobs(rows.top_ids, rows.top_logprobs) if top else None))
        engine._stats.scored_tokens += len(rows)
    return outputs


def _queue(engine, chosen, temperature: float, top: int, requests: list[Request]) -> None:
    """One request per sequence, appended to `requests` (so that a failure after any is
    queued finds them to abandon): its tokens but the last as the prompt, never sampled
    (greedy params: no seed is drawn, later rollouts' seeds do not shift)."""
    params = SamplingParams(temperature=0, max_tokens=1)
    with engine.journal.unit():
        for tokens, prefix in chosen:
            request = engine.requests.make(None, tokens[:-1], params, None, frozenset())
            request.seqs[0].score = ScoreState(tokens[1:], temperature, top, prefix)
            engine.requests.start(request)
            engine.scheduler.add(request.seqs[0])
            requests.append(request)


def check_probe(engine, probe, reference) -> tuple[list[int], list[float] | None] | None:
    """update_weights' probe checked before any weight moves: (token ids, reference)."""
    if probe is None:
        if reference is not None:
            raise ValueError("probe_reference needs a probe (the token ids it scores)")
        return None
    limit = engine.config.max_model_len
    tokens = token_ids("probe", probe, engine.vocab_size, engine.tokenizer, max_len=limit,
                       limit=f"max_model_len={limit}")[1]  # the length before any id is read
    if len(tokens) < 2:
        raise ValueError(f"probe: {len(tokens)} token; it needs at least 2 (the first is never "
                         f"scored) and at most max_model_len={limit}")
    if reference is not None:
        if isinstance(reference, (torch.Tensor, np.ndarray)):
            reference = reference.tolist()
        if not isinstance(reference, (list, tuple)):
            raise ValueError(f"probe_reference must be a list of logprobs, got "
                             f"{type(reference).__name__}")
        reference = [as_float("probe_reference", x) for x in reference]
        if len(reference) != len(tokens) - 1:
            raise ValueError(f"probe_reference: {len(reference)} logprobs for a probe of "
                             f"{len(tokens)} tokens (one per token after the first)")
    return tokens, reference


def run_probe(engine, tokens: list[int], reference: list[float] | None) -> dict:
    """The probe's logprobs under the weights just copied and, against the trainer's, the
    largest gap (in stats: a sync that copied the wrong weights shows here). Scoring steps the
    engine: carried requests may advance a step meanwhile, under the new weights. The probe
    counts in no score stat (scored_tokens, score_tokens_computed: Engine.score's calls')."""
    with _uncounted(engine):
        logprobs = score(engine, [tokens], 1.0, 0, 1, False)[0].logprobs
    gap = (math.nan if logprobs is None or reference is None
           else max(abs(a - b) for a, b in zip(logprobs, reference)))
    engine._stats.probe_gap = gap
    return {"probe_logprobs": logprobs, "probe_gap": gap}


@contextlib.contextmanager
def _uncounted(engine):
    """Score stats as they were before the block, however it ends: the engine's guard runs
    one call at a time and its carried requests are not scored ones, so what the block added
    is the probe's alone."""
    stats, committer = engine._stats, engine.committer
    scored, computed = stats.scored_tokens, committer.score_tokens_computed
    try:
        yield
    finally:
        stats.scored_tokens, committer.score_tokens_computed = scored, computed
