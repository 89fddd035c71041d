"""Builds one step's flat batch metadata, runs the model once, returns the logits to sample."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .attention import AttentionBackend, AttentionMetadata
from .scheduler import Batch
from .slot_table import SlotTable


class ForwardContext:
    """What every layer needs for this step: rotary cos/sin of the positions and attention."""

    __slots__ = ("cos", "sin", "meta", "backend")

    def __init__(self, cos, sin, meta: AttentionMetadata, backend: AttentionBackend) -> None:
        self.cos, self.sin, self.meta, self.backend = cos, sin, meta, backend

    def attend(self, q, k, v, layer: int, scale: float) -> torch.Tensor:
        return self.backend.forward(q, k, v, layer, self.meta, scale)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_index: torch.Tensor  # flat indices whose logits are sampled


class ModelRunner:
    def __init__(self, model, backend: AttentionBackend, table: SlotTable,
                 device: torch.device) -> None:
        self.model, self.backend, self.table, self.device = model, backend, table, device
        self.forward_seconds = 0.0

    def prepare(self, batch: Batch) -> StepInputs:
        items = batch.items
        q_lens = [it.num_new for it in items]
        kv_lens = [it.start + it.num_new for it in items]
        input_ids = [t for it in items for t in it.input_ids()]
        q_lens_t = torch.tensor(q_lens)
        kv_lens_t = torch.tensor(kv_lens)
        qo_indptr = torch.zeros(len(items) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=qo_indptr[1:])
        kv_indptr = torch.zeros(len(items) + 1, dtype=torch.int64)
        torch.cumsum(kv_lens_t, 0, out=kv_indptr[1:])
        starts = torch.tensor([it.start for it in items])
        num_tokens = int(qo_indptr[-1])
        positions = torch.arange(num_tokens) - torch.repeat_interleave(qo_indptr[:-1] - starts,
                                                                        q_lens_t)
        rows = torch.tensor([it.seq.row for it in items])
        kv_row = torch.repeat_interleave(rows, kv_lens_t)
        kv_col = torch.arange(int(kv_indptr[-1])) - torch.repeat_interleave(kv_indptr[:-1],
                                                                            kv_lens_t)
        # Sampled rows: each sampling item's last position, or all k+1 when verifying drafts.
        logits_index = []
        for it, end in zip(items, qo_indptr[1:].tolist()):
            if it.sample:
                logits_index += range(end - len(it.draft) - 1, end)
        dev = self.device
        meta = AttentionMetadata(
            qo_indptr=qo_indptr.to(dev, torch.int32), kv_indptr=kv_indptr.to(dev, torch.int32),
            kv_indices=self.table.table[kv_row.to(dev), kv_col.to(dev)],
            out_slots=batch.out_slots, q_lens=q_lens, kv_lens=kv_lens,
            groups=[it.seq.group for it in items],
            # Once the prompt is cached, Scheduler.cache_computed points the first num_prompt
            # slots of the row at the tree's, which are the same for every sample of the prompt.
            shared_lens=[it.seq.num_prompt if it.seq.cached_len >= it.seq.num_prompt else 0
                         for it in items])
        meta.plan = self.backend.plan(meta)
        return StepInputs(input_ids=torch.tensor(input_ids, device=dev),
                          positions=positions.to(dev), meta=meta,
                          logits_index=torch.tensor(logits_index, dtype=torch.long,
                                                    device=dev))

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits (fp32) of the sampled positions, in batch order."""
        t0 = time.perf_counter()
        dtype = self.model.model.embed_tokens.weight.dtype
        cos, sin = self.model.rope.lookup(inputs.positions, dtype)
        ctx = ForwardContext(cos, sin, inputs.meta, self.backend)
        hidden = self.model(inputs.input_ids, ctx)
        logits = self.model.compute_logits(hidden[inputs.logits_index])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - t0
        return logits
