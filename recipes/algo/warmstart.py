"""Supervised warm start: a few steps of teacher forcing on prompt -> answer, so a fresh model
earns some reward and GRPO has a signal. Kept short on purpose: RL has to do the rest.

A multi-turn task demonstrates whole episodes instead (`Task.demonstration`): the model's turns
are trained on, the environment's text in between is context only, as in RL (batch.py)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..run.config import RecipeConfig


def encode_examples(task, tokenizer, prompts: list, answers: list[str], device):
    """prompt + answer + eos, right-padded: (ids, attention mask, loss mask over answer + eos).
    Prompts (text, or a chat task's conversations) are encoded as the engine will see them
    (Task.encode)."""
    rows, masks = [], []
    for text, p, answer in zip(prompts, task.encode(tokenizer, prompts), answers):
        if task.demonstration is None:
            a = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
            rows.append(p + a)
            masks.append([0] * len(p) + [1] * len(a))
            continue
        row, mask = list(p), [0] * len(p)
        for segment, by_model in task.demonstration(text, answer):
            ids = tokenizer.encode(segment, add_special_tokens=False)
            row += ids
            mask += [int(by_model)] * len(ids)
        rows.append(row + [tokenizer.eos_token_id])
        masks.append(mask + [1])
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, :len(r)] = torch.tensor(r)
        attention[i, :len(r)] = 1
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids.to(device), attention.to(device), mask.to(device)


def logits_of(module, input_ids, attention_mask):
    """Logits from a plain causal LM or an ActorCritic (which returns (logits, values))."""
    out = module(input_ids=input_ids, attention_mask=attention_mask)
    return out[0] if isinstance(out, tuple) else out.logits


def warm_start(cfg: RecipeConfig, module, tokenizer, task, accelerator,
               same_batches_on_every_rank: bool = False) -> float:
    """`module`: the prepared (DDP) training module, whose ranks see different batches; or a
    plain model that every rank trains alike (`same_batches_on_every_rank`). Returns the last
    loss."""
    optimizer = accelerator.prepare(torch.optim.AdamW(module.parameters(), lr=cfg.warmstart_lr))
    # Per process, not per engine as rollouts are: no engine runs here, and data parallelism
    # over every rank wants each rank's own batches, whatever tensor_parallel_size is.
    rank = 0 if same_batches_on_every_rank else accelerator.process_index
    rng = random.Random(cfg.seed * 7919 + rank)
    prompts, answers = task.train["prompt"], task.train["answer"]
    if cfg.warmstart_examples is not None:  # a few demonstrations, seen again and again
        prompts, answers = prompts[:cfg.warmstart_examples], answers[:cfg.warmstart_examples]
    bar = tqdm(range(cfg.warmstart_steps), desc="warm start (supervised)", unit="step",
               disable=not (cfg.progress and accelerator.is_main_process))
    module.train()
    loss_value = float("nan")
    for _ in bar:
        pick = [rng.randrange(len(prompts)) for _ in range(cfg.warmstart_batch_size)]
        ids, attention, mask = encode_examples(task, tokenizer, [prompts[i] for i in pick],
                                               [answers[i] for i in pick], accelerator.device)
        logits = logits_of(module, ids, attention)
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                              reduction="none")
        loss = (nll * mask[:, 1:].flatten()).sum() / mask[:, 1:].sum()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        bar.set_postfix(loss=f"{loss_value:.3f}")
    return loss_value
