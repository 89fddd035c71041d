"""TRL's logprobs renormalised on the engine's sampled support (RolloutGRPOTrainer with
importance_ratio="on_support").

Under top-k / top-p / min-p the engine draws each token from the truncated, renormalised
distribution; its `sampling_logprobs` are that distribution's. TRL's importance ratio
pi/mu then compares two different distributions unless TRL's side is renormalised over the
same kept set. TRL 1.16 computes its per-token logprobs in a fused LM head that never holds the
logits (trl add_fused_lm_head), so a set of kept ids per token cannot be applied there: on
this path the policy's forward runs unfused (the model's own forward, with its logit scaling
and soft-capping, and TRL's `cast_lm_head_to_fp32` cast if set) and `logprobs_on_support`
renormalises log_softmax(logits / T) over each generated token's kept ids. The logits of one
chunk of rows are held, [rows, completion length, vocab] in float32, a few copies of it while
the log-softmax and entropy are formed: TRL's fused head exists to avoid that, so this mode
runs TRL's chunks in forwards of as many rows as keep one such tensor within LOGITS_BYTES.

The kept sets come from the rollout: `SupportTable` holds each row's (prompt + completion ids
-> Support) of the last generation batch, filled by EngineRollout and read here by the rows'
token ids, so TRL's shuffling and splitting of the batch do not matter. Equal rows have equal
supports (the kept set at a position is a function of the tokens before it).
"""

from __future__ import annotations

import torch

from rollout.colocation.weights import unwrap
from rollout.sample.support import Support, logprobs_on_support

LOGITS_BYTES = 256 << 20  # one forward's float32 logits, at most (but for a single row)


class SupportTable:
    """prompt + completion ids -> the completion's Support, for the last generation batch."""

    def __init__(self) -> None:
        self._rows: dict[tuple[int, ...], Support] = {}

    def clear(self) -> None:
        self._rows.clear()

    def add(self, prompt_ids, completion_ids, support: Support) -> None:
        self._rows[(*prompt_ids, *completion_ids)] = support

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, ids: torch.Tensor, mask: torch.Tensor) -> Support:
        """The Support of the row whose real tokens (mask 1) are `ids`."""
        key = tuple(ids[mask.bool()].tolist())
        support = self._rows.get(key)
        if support is None:
            raise RuntimeError(f"importance_ratio='on_support': no sampled support for a row "
                               f"of {len(key)} tokens; on-support logprobs are only defined "
                               f"for completions this trainer's engine sampled in its last "
                               f"generation batch")
        return support


def on_support_logps(model, table: SupportTable, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor, logits_to_keep: int, temperature: float,
                     batch_size: int, compute_entropy: bool, compute_aux_loss: bool,
                     autocast) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """What GRPOTrainer._get_per_token_logps_and_entropies returns (per-token logprobs
    [B, logits_to_keep], entropies or None, MoE aux loss or None), the logprobs on each row's
    support; positions past a completion's end (padding, masked by TRL) get the full
    log-softmax. Entropies are the full distribution's, as TRL's fused head gives them."""
    all_logps, all_entropies, all_aux = [], [], []
    vocab = unwrap(model).config.get_text_config().vocab_size  # DDP wraps the policy
    per_row = (logits_to_keep + 1) * vocab * 4
    batch_size = max(1, min(batch_size, LOGITS_BYTES // per_row))
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
        extra = {"output_router_logits": True} if compute_aux_loss else {}
        with autocast():
            out = model(input_ids=ids, attention_mask=mask, logits_to_keep=logits_to_keep + 1,
                        **extra)
        logits = out.logits[:, :-1].float()  # row j predicts completion token j
        tokens = ids[:, -logits_to_keep:]
        full = (logits / temperature).log_softmax(-1)
        logps = full.gather(-1, tokens[..., None].long()).squeeze(-1)
        rows = []
        for row in range(ids.size(0)):
            if not mask[row, -logits_to_keep:].any():
                # No completion token counts (TRL's mask_truncated_completions masks a
                # truncated one whole): out of the loss, and not a row the table can name.
                rows.append(logps[row])
                continue
            support = table.get(ids[row], mask[row])
            n = len(support)
            kept = logprobs_on_support(logits[row, :n], support, temperature, tokens[row, :n])
            rows.append(torch.cat([kept, logps[row, n:]]))
        all_logps.append(torch.stack(rows))
        if compute_entropy:
            all_entropies.append(-(full.exp() * full).sum(-1))
        if compute_aux_loss:
            all_aux.append(out.aux_loss)
    entropies = torch.cat(all_entropies) if compute_entropy else None
    aux_loss = torch.stack(all_aux).mean() if compute_aux_loss else None
    return torch.cat(all_logps), entropies, aux_loss
