"""What generate returns: one RolloutOutput per prompt, with its n samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sample.support import Support
from ..score.state import TopLogprobs


@dataclass
class Sample:
    index: int
    token_ids: list[int]
    logprobs: list[float] | None  # log_softmax(logits / T) of each token; None unless asked
    finish_reason: str  # "stop" | "length" | "abort"
    text: str | None = None
    # SamplingParams.return_routed_experts (MoE models): int16 [P + N - 1, num MoE layers, k]
    # for a prompt of P tokens and N = len(token_ids): row p holds the expert ids each MoE
    # layer chose (in the router's top-k order) in the forward whose input was token p of
    # prompt + completion, the forward that computed the K/V the sample held when it finished
    # (what the tokens sampled under the last weights attended to). The last completion token
    # is never an input: it has no row (pad it when the trainer routes it). None unless asked,
    # and for an aborted sample.
    routed_experts: torch.Tensor | None = None
    # SamplingParams.logprobs: each token's log-probability under the distribution it was drawn
    # from (temperature, then top-k / top-p / min-p, renormalised; 0 for a greedy token): equal
    # to `logprobs` where nothing truncated. SamplingParams.return_support: support[j], the
    # token ids that distribution kept (rollout/sample/support.py, logprobs_on_support).
    sampling_logprobs: list[float] | None = None
    support: Support | None = None
    # Engine.weights_version each token was sampled under: one value unless the sample was
    # carried across update_weights (Engine.rollout; rollout/engine/carry.py).
    weights_versions: list[int] = field(default_factory=list)
    # SamplingParams.top_logprobs = k: each token's k most likely alternatives under the
    # distribution `logprobs` reports (top_logprobs[j]: {token id: logprob}).
    top_logprobs: TopLogprobs | None = None
    # With routed_experts: int32 [P + N - 1], the weights version of the forward that computed
    # each row (last field: positional fields keep their places). A sample carried across
    # update_weights (Engine.rollout) with carried_kv="recompute" had every row recomputed under
    # the new weights: a token j with weights_versions[j] older than routed_versions[P + j - 1]
    # was sampled under other routes than its rows hold. docs/moe.md.
    routed_versions: torch.Tensor | None = None
    # With routed_experts, for a sample carried across update_weights with carried_kv=
    # "recompute": per update, oldest first, the (routed_experts, routed_versions) of the rows
    # its K/V held just before it (as far as the prefix cache still held them), the routes its
    # tokens of that version were sampled under. Empty when none.
    earlier_routes: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(self.logprobs)


@dataclass
class RolloutOutput:
    request_id: str
    prompt_token_ids: list[int]
    samples: list[Sample] = field(default_factory=list)
    prompt: str | None = None
    # Why the engine aborted the request (non-finite logits, a failing stop check); the
    # samples that had finished before keep their tokens and reasons.
    error: str | None = None
    # Engine.weights_version when it completed: that of its newest tokens (a group carried
    # across update_weights has older ones too: Sample.weights_versions).
    weights_version: int = 0


def build_output(group, decode, vocab_size: int, weights_version: int = 0) -> RolloutOutput:
    """The output of a finished `requests.request.Request`. `decode(seq)` gives a sample's text
    (None without a tokenizer); a tokenizer that fails here costs the text, not the tokens.
    Its weights version is the one it completed under (however many updates came before it
    is handed out); `weights_version`, the engine's now, for one that never completed."""
    samples, error = [], group.error
    for seq in group.seqs:
        try:
            text = decode(seq)
        except Exception as e:  # user tokenizer code, after the request finished
            text, error = None, error or f"detokenize: {type(e).__name__}: {e}"
        samples.append(Sample(
            index=seq.sample_index, token_ids=seq.output_ids,
            logprobs=list(seq.logprobs) if group.params.logprobs else None,
            finish_reason=seq.finish_reason, text=text,
            **_routes(seq, group.params.return_routed_experts),
            sampling_logprobs=list(seq.sampling_logprobs) if group.params.logprobs else None,
            support=Support(list(seq.support), vocab_size) if group.params.return_support
            else None, weights_versions=seq.token_versions(),
            top_logprobs=_tops(seq) if group.params.top_logprobs else None))
    completed = group.completed_version
    return RolloutOutput(group.request_id, group.prompt_ids, samples, group.prompt, error,
                         weights_version if completed is None else completed)


def _routes(seq, asked: bool) -> dict:
    """Sample's routed_experts, routed_versions and earlier_routes: None unless asked and
    finished."""
    if not asked or seq.routed_experts is None:
        return {"routed_experts": None, "routed_versions": None, "earlier_routes": None}
    routes, versions = seq.routed_experts
    return {"routed_experts": routes, "routed_versions": versions,
            "earlier_routes": list(seq.earlier_routes)}


def _tops(seq) -> TopLogprobs:
    k = seq.params.top_logprobs
    if not seq.top_logprobs:
        return TopLogprobs(torch.empty(0, k, dtype=torch.long), torch.empty(0, k))
    return TopLogprobs(torch.stack([ids for ids, _ in seq.top_logprobs]),
                       torch.stack([lps for _, lps in seq.top_logprobs]))
