"""The engine's outputs against transformers' own forward of the same model: teacher-forced,
each generated token and its logprob, held to the reference's own floor (floors.py)."""

from __future__ import annotations

import torch
from floors import assert_within_floor, exact_copy, token_logprobs

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 50)), [42] * 17, [5, 99, 3, 100, 6, 7]]


def assert_matches_reference(model, prompts, outs, margin=1e-4, atol=None, greedy=True,
                             temperature=1.0, exact=None):
    """Each engine token is the reference's argmax (or within `margin` of it; `greedy` False:
    sampled tokens, not checked), and the engine's logprobs are as near the exact answer (a
    float64 forward) as transformers' own float32 forward is: their mean error within twice
    its mean, their largest within TAIL_MULTIPLE times its largest (floors.py). `atol`: a fixed
    bound against the model's own forward instead, for references that are not float32 on the
    CPU (the GPU tests). `temperature`: the sampled requests', whose logprobs are
    log_softmax(logits / temperature). `exact`: the float64 copy, where the caller keeps one."""
    if atol is None and exact is None:
        exact = exact_copy(model)
    errors, floors, values = [], [], []
    for prompt, out in zip(prompts, outs):
        for sample in out.samples:
            tokens = sample.token_ids
            full = torch.tensor([prompt + tokens], device=model.device)
            with torch.no_grad():
                logits = model(full).logits[0, len(prompt) - 1:-1].float().cpu()
            top2 = logits.topk(2, dim=-1)
            chosen = logits.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
            close = (top2.values[:, 0] - chosen) < margin
            assert bool(close.all()) or not greedy, \
                f"greedy token is not the reference argmax: {tokens}"
            ref = (logits / temperature).log_softmax(-1)
            ref = ref.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
            got = torch.tensor(sample.logprobs, dtype=torch.float64)
            if atol is not None:
                err = (ref.double() - got).abs().max().item()
                assert err < atol, f"logprob error {err}"
                continue
            truth = token_logprobs(exact, prompt, tokens, temperature)
            errors.append((got - truth).abs())
            floors.append((ref.double() - truth).abs())
            values.append(truth)
    if atol is None:
        assert_within_floor(torch.cat(errors), torch.cat(floors), torch.cat(values))


def assert_paths_agree(model, prompts, params, *runs, atol=None):
    """Engine paths (backends, caches) on the same requests (`params`): the same tokens, and
    each path's logprobs held to the float64 floor as assert_matches_reference holds them, not
    a fixed distance between the paths (`atol`: as there, for a reference off the CPU)."""
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    exact = exact_copy(model) if atol is None else None  # one float64 copy for every path
    for outs in runs:
        assert_matches_reference(model, prompts, outs, atol=atol, greedy=False,
                                 temperature=params.temperature or 1.0, exact=exact)
