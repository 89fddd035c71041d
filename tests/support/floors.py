"""Tolerances from the reference's own variation on this machine, not from a fixed number.

Two measures of how exact the reference itself is, each taken on the same model, sequences and
machine in the same test (how large they are depends on the ISA, AVX2 or AVX-512, the BLAS and
the thread count):

- transformers' float32 forward against a float64 copy of the same model (the exact answer, to
  float32's purposes): the engine, held to the float64 answer, may be FLOOR_MULTIPLE times as
  far from it as transformers' own float32 forward is;
- transformers' forward of a sequence alone against it inside a padded batch (other matmul
  shapes, other reduction orders), where the reference is a trainer's batched forward (TRL).
"""

from __future__ import annotations

import copy

import torch

# The engine's fp32 gap may be this many times the reference's own batched-vs-alone spread.
FLOOR_MULTIPLE = 2.0
# A spread below a few float32 ulps of the values compared is no floor (the reference happened to
# round the same way in both shapes): the floor is then that many ulps.
MIN_ULPS = 8


def tolerance(floor: float, values: torch.Tensor) -> float:
    """The bound for an engine-vs-reference gap, given the reference's own spread `floor` over
    `values` (the logprobs compared)."""
    ulp = torch.finfo(torch.float32).eps * values.abs().max().item()
    return FLOOR_MULTIPLE * max(floor, MIN_ULPS * ulp)


@torch.no_grad()
def alone_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                   temperature: float) -> torch.Tensor:
    """Each completion's token logprobs from a transformers forward of its row alone, without
    padding: the reference the batched forward is compared with to measure its spread."""
    training = model.training
    model.eval()
    out = torch.zeros(completion_ids.shape, dtype=torch.float32)
    for i in range(prompt_ids.shape[0]):
        prompt = prompt_ids[i][prompt_mask[i].bool()]
        n = int(completion_mask[i].sum())
        seq = torch.cat([prompt, completion_ids[i, :n]])[None]
        logits = model(seq).logits[0, len(prompt) - 1:-1].float() / temperature
        out[i, :n] = torch.log_softmax(logits, -1).gather(1, seq[0, len(prompt):, None])[:, 0]
    model.train(training)
    return out


def exact_copy(model):
    """A float64 copy of `model` on the CPU: the exact answer float32 forwards are judged by.
    MoE layers take transformers' eager experts (its grouped matmul has no float64)."""
    exact = copy.deepcopy(model).to("cpu", torch.float64)
    if hasattr(exact.config, "_experts_implementation"):
        exact.config._experts_implementation = "eager"
    return exact.eval()


@torch.no_grad()
def token_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of `model`'s forward at each of `tokens` after `prompt`, float64."""
    seq = torch.tensor([prompt + tokens])
    logits = model(seq).logits[0, len(prompt) - 1:-1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
