"""The distribution a token was drawn from, for the trainer: its log-probability there
(`sampling_logprobs`) and the token ids it kept (`support`).

With top-k / top-p / min-p a token is drawn from the truncated distribution: temperature, then
the filters, renormalised over the tokens they keep. `log_softmax(logits / T)` (the engine's
`logprobs`, what a trainer recomputes) is the untruncated policy; an importance ratio of the
two is biased wherever the filters cut (TRL and vLLM users measured a mean ratio of 0.9 at
top_p = 0.8). The engine reports both, and the kept set, so a trainer can renormalise its own
logits over exactly the same tokens (`logprobs_on_support`, with autograd).

A greedy token is drawn from a point mass: its sampling logprob is 0 and its support the token.
A row nothing truncates keeps the whole vocabulary: its sampling logprob is its logprob, and its
support is stored as "all" (`Support` gives `arange(vocab)` for it when asked).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..fields import as_float
from .log_softmax import row_logsumexp


def support_ids(candidates: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """The kept token ids (int32, ascending, on the CPU) of each of `rows` of `candidates`
    (the filtered log-probabilities, -inf where a filter cut)."""
    if not rows:
        return []
    kept = candidates[torch.tensor(rows, device=candidates.device)] > float("-inf")
    counts = kept.sum(dim=-1).tolist()
    ids = kept.nonzero()[:, 1].to(torch.int32).cpu()
    return list(ids.split(counts))


def truncated_logprobs(candidates: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under each row's renormalised candidates: candidates[t] - logsumexp."""
    lse = row_logsumexp(candidates)
    return (candidates.gather(-1, tokens[:, None]) - lse).squeeze(-1)


def sampled_at(candidates: torch.Tensor | None, rows: list[int], tokens: list[int],
               logprobs: list[float], greedy: Sequence[bool], truncated: Sequence[bool],
               want_support: Sequence[bool], want_logprobs: Sequence[bool] | None = None
               ) -> tuple[list[float], list]:
    """For each (rows[i], tokens[i]) with its full-policy logprob: (its sampling logprob, its
    support: kept ids, or None for the whole vocabulary; None too where not wanted). Rows are
    indices into `candidates` and the per-row flags; a row not in `want_logprobs` (default:
    all) skips the renormalisation (its sampling logprob is then its logprob, unused)."""
    # (Each per-row pass only where a flag is set anywhere: a rollout's step has none.)
    if any(truncated):
        truncated = _cutting(candidates, rows, truncated, want_support, want_logprobs)
    sampling = ([0.0 if greedy[r] else lp for r, lp in zip(rows, logprobs)] if any(greedy)
                else list(logprobs))
    cut = [i for i, r in enumerate(rows)
           if truncated[r] and (want_logprobs is None or want_logprobs[r])] \
        if any(truncated) else []
    if cut:
        picked = [rows[i] for i in cut]
        block = candidates if picked == list(range(candidates.shape[0])) else \
            candidates[torch.tensor(picked, device=candidates.device)]  # (a copy: [cut, V])
        chosen = torch.tensor([tokens[i] for i in cut], device=candidates.device)
        for i, lp in zip(cut, truncated_logprobs(block, chosen).tolist()):
            sampling[i] = lp
    supports: list = [None] * len(rows)
    if not any(want_support):
        return sampling, supports
    kept = iter(support_ids(candidates, [r for r in rows if truncated[r] and want_support[r]])
                if candidates is not None else ())
    for i, (r, token) in enumerate(zip(rows, tokens)):
        if want_support[r] and greedy[r]:
            supports[i] = torch.tensor([token], dtype=torch.int32)
        elif want_support[r] and truncated[r]:
            supports[i] = next(kept)
    return sampling, supports


def _cutting(candidates: torch.Tensor, rows: list[int], truncated: Sequence[bool],
             want_support: Sequence[bool], want_logprobs: Sequence[bool] | None
             ) -> Sequence[bool]:
    """`truncated` (set from the row's filters) less the reported rows whose filters kept every
    token: whether a filter cuts depends on the row (min-p's threshold on its top token, a cut
    among tied values), and a row that kept the whole vocabulary was drawn from it, as with
    top_k >= vocab or top_p = 1 (SamplingParams.validate turns those off)."""
    asked = sorted({r for r in rows if truncated[r]
                    and (want_support[r] or want_logprobs is None or want_logprobs[r])})
    if not asked:
        return truncated
    # every row asked (a rollout with logprobs): no gathered copy of the [rows, V] block
    part = candidates if len(asked) == candidates.shape[0] else \
        candidates[torch.tensor(asked, device=candidates.device)]
    whole = part.amin(dim=-1) > float("-inf")
    truncated = list(truncated)
    for r, kept_all in zip(asked, whole.tolist()):
        truncated[r] = not kept_all
    return truncated


class Support(Sequence):
    """The kept ids of each generated token of one sample: `support[j]` is a 1-D int32 tensor.
    Stored compactly: `None` for a token drawn from the whole vocabulary."""

    __slots__ = ("_rows", "vocab_size")

    def __init__(self, rows: list[torch.Tensor | None], vocab_size: int) -> None:
        self._rows, self.vocab_size = rows, vocab_size

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return Support(self._rows[j], self.vocab_size)
        row = self._rows[j]
        return torch.arange(self.vocab_size, dtype=torch.int32) if row is None else row

    def is_full(self, j: int) -> bool:
        """Whether token j was drawn from the whole vocabulary (nothing truncated)."""
        return self._rows[j] is None

    def mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """bool [len, vocab]: True where a token was kept."""
        out = torch.ones(len(self), self.vocab_size, dtype=torch.bool, device=device)
        cut = [j for j, row in enumerate(self._rows) if row is not None]
        if cut:
            out[cut] = False
            rows = torch.cat([torch.full((len(self._rows[j]),), j) for j in cut])
            cols = torch.cat([self._rows[j].long() for j in cut])
            out[rows.to(device), cols.to(device)] = True
        return out

    def __repr__(self) -> str:
        cut = sum(row is not None for row in self._rows)
        return f"Support({len(self)} tokens, {cut} truncated, vocab {self.vocab_size})"


def logprobs_on_support(logits: torch.Tensor, support: Support | Sequence[torch.Tensor],
                        temperature: float = 1.0, tokens: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """The trainer's side: `logits` [T, V] of the generated positions (from its own forward,
    with autograd) renormalised over each position's kept tokens, as the engine drew them:
    log_softmax(logits / temperature) restricted to support[j], -inf outside it. With `tokens`
    [T] (a tensor or list of ids, each in its position's support), the log-probabilities at
    them ([T]); else the whole [T, V]. `support`: a Sample's Support, or T id tensors or lists,
    none empty. A bad argument raises ValueError naming it; the checks are a few whole-tensor
    reductions, no loop over ids."""
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 \
            or not logits.is_floating_point():
        got = (f"shape {tuple(logits.shape)}, dtype {logits.dtype}"
               if isinstance(logits, torch.Tensor) else type(logits).__name__)
        raise ValueError(f"logits must be a 2-D floating torch.Tensor [T, V], got {got}")
    temperature = as_float("temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (a greedy token's support is itself), got "
                         f"{temperature!r}")
    rows, vocab = logits.shape
    if isinstance(support, Support):
        if support.vocab_size != vocab:
            raise ValueError(f"support: vocabulary {support.vocab_size}, logits {vocab}")
        given = support._rows
    elif isinstance(support, (str, bytes)) or not isinstance(support, Iterable):
        raise ValueError(f"support must be a Support or a list of T id tensors or lists, got "
                         f"{type(support).__name__}")
    else:
        given = list(support)
    if len(given) != rows:
        raise ValueError(f"support: {len(given)} positions for {rows} logits rows")
    # None: the whole vocabulary (as a Support stores it)
    kept = [None if row is None else _ids(f"support[{j}]", row) for j, row in enumerate(given)]
    cut = [j for j, row in enumerate(kept) if row is not None]
    sizes = [len(kept[j]) for j in cut]
    if 0 in sizes:  # its row would be all NaN
        raise ValueError(f"support[{cut[sizes.index(0)]}] is empty; each position keeps at "
                         f"least its token")
    if cut:
        ends = torch.tensor(sizes).cumsum(0)
        _check_range(torch.cat([kept[j] for j in cut]), vocab,
                     lambda i: f"support[{cut[int(torch.searchsorted(ends, i, right=True))]}]")
    mask = Support(kept, vocab).mask(logits.device)
    scaled = (logits.float() / temperature).masked_fill(~mask, float("-inf"))
    logp = scaled.log_softmax(dim=-1)
    if tokens is None:
        return logp
    tokens = _ids("tokens", tokens).to(logits.device)
    if len(tokens) != rows:
        raise ValueError(f"tokens: {len(tokens)} ids for {rows} logits rows")
    _check_range(tokens, vocab, lambda i: f"tokens[{i}]")
    inside = mask.gather(-1, tokens.long()[:, None]).squeeze(-1)
    if not inside.all():
        j = int((~inside).nonzero()[0])
        raise ValueError(f"tokens[{j}]: id {int(tokens[j])} is not in support[{j}] (a token "
                         f"is drawn from its position's support)")
    return logp.gather(-1, tokens.long()[:, None]).squeeze(-1)


def _ids(name: str, value) -> torch.Tensor:
    """`value` (a tensor, array or list of ints) as a 1-D integer tensor, converted whole."""
    ids = value
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):  # ragged, strings, objects
            raise ValueError(f"{name} must be a 1-D tensor or list of int token ids, got "
                             f"{type(value).__name__}") from None
    if ids.ndim == 1 and ids.numel() == 0:
        return ids.long()  # [] reads as float32: no id in it to be wrong
    if ids.ndim != 1 or ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"{name} must be a 1-D tensor or list of int token ids, got shape "
                         f"{tuple(ids.shape)}, dtype {ids.dtype}")
    return ids


def _check_range(ids: torch.Tensor, vocab: int, name) -> None:
    """Every id in [0, vocab) (a negative one would index from the end): one reduction;
    `name(i)` names the argument holding the first bad one, at position i of `ids`."""
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"{name(i)}: id {int(ids[i])} is outside the vocabulary [0, {vocab})")

