"""Decode steps replayed from CUDA graphs.

A decode step of a small model is bound by the host: the Python of every layer and hundreds of
kernel launches cost more than the kernels themselves. Here the forward of a decode-only step
(embedding to logits of every row) is captured once per batch-size bucket into a CUDA graph over
static input buffers; a step pads its batch to the next bucket, copies its inputs in with a
constant number of ops, and replays.

- Padded rows decode token 0 at position 0 over a one-slot context (slot 0): they write no K/V
  (out slot -1) and their logits are dropped.
- Every graph writes its logits into one shared buffer [max batch, vocab]: a logits tensor per
  graph would hold hundreds of MB across the buckets at a 150K vocabulary. The graphs' other
  intermediates share one memory pool (they never run concurrently).
- A graph fixes launch parameters: the attention backend's `graph_plan` gives them (Triton:
  max_kv_len = max_model_len, split-KV sized for the longest context, programs past a row's
  real length exit at once; no shared-prefix path, whose grouping changes every step).
- Graphs hold the addresses of the KV pool and the weights. Sleep frees both, so it drops the
  graphs and their buffers; each bucket is captured again on its first use after waking.
  `update_weights` copies in place and keeps them.
- Off CUDA (tests), an eager stand-in keeps the same contract: the captured function sees only
  the static buffers and what it closed over at capture.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..attention.base import AttentionBackend
from ..attention.metadata import AttentionMetadata
from ..colocation.device_memory import clear_cublas_workspaces
from .context import ForwardContext


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph: small steps fine-grained (padding there is most of the batch),
    large ones every 32."""
    small = [1, 2, 4, 8, 16, 24, 32]
    return [b for b in small if b < max_batch] + list(range(64, max_batch, 32)) + [max_batch]


@dataclass
class _StaticInputs:
    input_ids: torch.Tensor  # int64 [max_batch]
    positions: torch.Tensor  # int64 [max_batch]
    out_slots: torch.Tensor  # int64 [max_batch]
    qo_indptr: torch.Tensor  # int32 [max_batch + 1], always 0, 1, 2, ...
    kv_indptr: torch.Tensor  # int32 [max_batch + 1]
    kv_indices: torch.Tensor  # int32 [max_batch * max_model_len]
    pad_ramp: torch.Tensor  # int32 [max_batch]: 1, 2, ... (the padded rows' context ends)
    logits: torch.Tensor  # fp32 [max_batch, vocab]: the output of every graph

    @classmethod
    def allocate(cls, max_batch: int, max_model_len: int, vocab_size: int,
                 device) -> _StaticInputs:
        def ints(n, dtype=torch.int64):
            return torch.zeros(n, dtype=dtype, device=device)

        return cls(logits=torch.empty(max_batch, vocab_size, device=device),
                   input_ids=ints(max_batch), positions=ints(max_batch),
                   out_slots=ints(max_batch),
                   qo_indptr=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
                   kv_indptr=ints(max_batch + 1, torch.int32),
                   kv_indices=ints(max_batch * max_model_len, torch.int32),
                   pad_ramp=torch.arange(1, max_batch + 1, dtype=torch.int32, device=device))


class _CudaGraph:
    def __init__(self, forward, pool) -> None:
        # Warm-up outside the capture: Triton compiles, cuBLAS chooses its kernels.
        # cuBLAS workspaces are cleared around both (as torch's inductor does): the warm-up
        # stream's would stay allocated for good; the capture's is then made inside the graphs'
        # pool, which its replays keep, instead of a cached one that outlives the graphs.
        clear_cublas_workspaces()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        clear_cublas_workspaces()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = forward()
        clear_cublas_workspaces()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class _EagerGraph:
    def __init__(self, forward, pool) -> None:
        self.forward = forward

    def replay(self) -> torch.Tensor:
        return self.forward()


class DecodeGraphs:
    def __init__(self, model, attention: AttentionBackend, max_batch: int, max_model_len: int,
                 device: torch.device) -> None:
        self.model, self.attention, self.device = model, attention, device
        self.max_model_len = max_model_len
        self.buckets = decode_buckets(max_batch)
        self.graphs: dict[int, _CudaGraph | _EagerGraph] = {}
        self.static: _StaticInputs | None = None
        self.pool = None
        self.replays = 0
        # Captures (each a warm-up forward and the capture; sleep drops every graph, so each
        # wake-up captures again the buckets it uses) and the seconds they took.
        self.captures = 0
        self.capture_seconds = 0.0

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step (one new token per request)."""
        batch = input_ids.shape[0]
        size = next(b for b in self.buckets if b >= batch)
        if self.static is None:
            self.static = _StaticInputs.allocate(self.buckets[-1], self.max_model_len,
                                                 self.model.vocab_size, self.device)
            self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self._fill(batch, size, input_ids, positions, meta)
        graph = self.graphs.get(size)
        if graph is None:
            kind = _CudaGraph if self.device.type == "cuda" else _EagerGraph
            t0 = time.perf_counter()
            graph = self.graphs[size] = kind(self._forward(size), self.pool)
            self.captures += 1
            self.capture_seconds += time.perf_counter() - t0
        self.replays += 1
        return graph.replay()[:batch]

    def _fill(self, batch: int, size: int, input_ids, positions, meta) -> None:
        s, total = self.static, sum(meta.kv_lens)
        s.input_ids[:batch].copy_(input_ids)
        s.positions[:batch].copy_(positions)
        s.out_slots[:batch].copy_(meta.out_slots)
        s.kv_indptr[:batch + 1].copy_(meta.kv_indptr)
        s.kv_indices[:total].copy_(meta.kv_indices)
        if size > batch:
            pad = size - batch
            s.input_ids[batch:size].zero_()
            s.positions[batch:size].zero_()
            s.out_slots[batch:size].fill_(-1)
            s.kv_indices[total:total + pad].zero_()
            torch.add(s.pad_ramp[:pad], total, out=s.kv_indptr[batch + 1:size + 1])

    def _forward(self, size: int):
        s, model, max_len = self.static, self.model, self.max_model_len
        plan = self.attention.graph_plan(size, max_len)

        def forward() -> torch.Tensor:
            meta = AttentionMetadata(
                qo_indptr=s.qo_indptr[:size + 1], kv_indptr=s.kv_indptr[:size + 1],
                kv_indices=s.kv_indices, out_slots=s.out_slots[:size], q_lens=[1] * size,
                kv_lens=[max_len] * size, plan=plan)
            ctx = ForwardContext(s.positions[:size], meta, self.attention)
            hidden = model(s.input_ids[:size], ctx)
            return s.logits[:size].copy_(model.compute_logits(hidden))

        return forward

    def release(self) -> None:
        """Drop graphs and buffers (sleep frees what they point at)."""
        self.graphs.clear()
        self.static = self.pool = None
