"""Builds one step's flat batch metadata, runs the model once, returns the logits to sample."""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from ..attention.base import AttentionBackend
from ..attention.metadata import AttentionMetadata, indptr, ranges
from ..kv.slot_table import SlotTable
from ..ops.host_lists import host_tensor
from ..requests.batch import Batch
from ..score.rows import ScoreInputs, score_inputs, score_rows
from ..score.state import ScoreRows
from .context import ForwardContext

if TYPE_CHECKING:
    from .cuda_graph import DecodeGraphs


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_index: torch.Tensor  # flat indices whose logits are sampled
    graphed: bool = False  # a decode-only step replayed from a CUDA graph
    score: ScoreInputs | None = None  # rows of scored sequences (Engine.score)


class ModelRunner:
    def __init__(self, model, attention: AttentionBackend, table: SlotTable,
                 device: torch.device, graphs: DecodeGraphs | None = None) -> None:
        self.model, self.attention, self.table, self.device = model, attention, table, device
        self.graphs = graphs
        self.forward_seconds = 0.0

    def prepare(self, batch: Batch) -> StepInputs:
        items, dev = batch.items, self.device
        q_lens = [it.num_new for it in items]
        kv_lens = [it.start + it.num_new for it in items]
        # Sampled rows: each sampling item's last position, or all k+1 when verifying drafts.
        logits_index = []
        for it, end in zip(items, accumulate(q_lens)):
            if it.sample:
                logits_index += range(end - len(it.draft) - 1, end)
        # Row r of the slot table starts at flat index r * width: each request's context
        # slots are one range of the flattened table.
        width = self.table.table.shape[1]
        context = ranges([it.seq.row * width for it in items], kv_lens, dev)
        meta = AttentionMetadata(
            qo_indptr=indptr(q_lens, dev), kv_indptr=indptr(kv_lens, dev),
            kv_indices=self.table.table.view(-1)[context],
            out_slots=batch.out_slots, q_lens=q_lens, kv_lens=kv_lens,
            # A sample going on from parked K/V (carried_kv="park") holds its prompt in a
            # tagged branch of its own (KVManager.keep_stale), not its fresh siblings' slots.
            groups=[it.seq.group if (kv := it.seq.prompt_kv) is None else (it.seq.group, kv)
                    for it in items],
            # Once the prompt is cached, KVManager.cache_computed points the first num_prompt
            # slots of the row at the tree's, which are the same for every sample of the prompt
            # (and tag).
            shared_lens=[it.seq.num_prompt if it.seq.cached_len >= it.seq.num_prompt else 0
                         for it in items])
        score = score_inputs(items, dev)
        # A decode-only step (every item one new token, sampled) can replay a graph.
        graphed = (self.graphs is not None and len(logits_index) == len(items)
                   and max(q_lens) == 1 and self.graphs.fits(len(items)) and score is None)
        if not graphed:
            meta.plan = self.attention.plan(meta)
        return StepInputs(
            input_ids=host_tensor([t for it in items for t in it.input_ids()], torch.int64, dev),
            positions=ranges([it.start for it in items], q_lens, dev), meta=meta,
            logits_index=host_tensor(logits_index, torch.int64, dev),
            graphed=graphed, score=score)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, ScoreRows | None]:
        """Logits (fp32) of the sampled positions, in batch order, and the scored rows (on the
        host) when the step has some."""
        t0 = time.perf_counter()
        scored = None
        # In the engine's dtype whatever autocast the caller left on (a trainer's mixed-
        # precision step): it would change the logprobs, hand the fp32 kernels tensors of
        # another dtype, and be captured into a CUDA graph at its first replay.
        with torch.autocast(self.device.type, enabled=False):
            if inputs.graphed:
                logits = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
            else:
                ctx = ForwardContext(inputs.positions, inputs.meta, self.attention)
                hidden = self.model(inputs.input_ids, ctx)
                if inputs.logits_index.numel():
                    logits = self.model.compute_logits(hidden[inputs.logits_index])
                else:  # only scored rows (a tensor-parallel head cannot gather none)
                    logits = torch.empty(0, self.model.vocab_size, device=hidden.device)
                if inputs.score is not None:
                    scored = score_rows(self.model.compute_logits, hidden, inputs.score,
                                        self.model.vocab_size)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - t0
        return logits, scored
