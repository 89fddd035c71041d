"""A model with the KV machinery that serves it: pool, prefix cache, slot table, KV manager,
attention backend, runner, and the parking of its weights for sleep. The engine holds one for
its model (and a scheduler over its KV manager); the draft-model drafter holds another for the
draft."""

from __future__ import annotations

import torch

from .attention import make_backend
from .config import EngineConfig
from .journal import Journal
from .kv_manager import KVManager
from .kv_pool import KVPool
from .model_runner import ModelRunner
from .no_prefix_cache import make_prefix_cache
from .sleep import WeightParking
from .slot_table import SlotTable


class ModelStack:
    def __init__(self, model, config: EngineConfig, num_slots: int, device: torch.device,
                 journal: Journal) -> None:
        self.model, self.device = model, device
        self.pool = KVPool(model.config.num_hidden_layers, num_slots, model.num_kv_heads,
                           model.head_dim, model.model.embed_tokens.weight.dtype, device)
        self.table = SlotTable(config.max_num_seqs, config.max_model_len, device)
        cache = make_prefix_cache(config.enable_prefix_caching, device)
        self.kv = KVManager(self.pool, cache, self.table, journal)
        self.backend = make_backend(config.attention_backend, self.pool)
        self.graphs = None
        if config.cuda_graphs:
            self.graphs = decode_graphs(model, self.backend, config, device)
        self.runner = ModelRunner(model, self.backend, self.table, device, self.graphs)
        self.parking = WeightParking(model, device)

    def sleep(self, level: int) -> None:
        """Drop the KV pool (the tree empties with it) and park the weights (see sleep.py).
        On a stack asleep at level 1, sleep(2) deepens in place: nothing is allocated. Every
        part is idempotent, so a sleep that failed half way can be finished or undone."""
        if self.graphs is not None:
            self.graphs.release()
        # The pool goes before the tree is forgotten: a failure between them leaves either
        # both (consistent) or no pool (wake_up then starts both afresh).
        self.pool.release()
        self.kv.reset()
        self.table.release()
        self.model.rope.release()
        self.parking.park(level)

    def wake_up(self) -> None:
        """Bring back what sleep dropped; what a failed sleep left in place is kept."""
        self.parking.restore()
        if self.model.rope.cos_table is None:
            self.model.rope.build(self.device)
        if not self.pool.is_allocated:
            self.kv.reset()
            self.pool.allocate()
            self.table.allocate()


def decode_graphs(model, backend, config: EngineConfig, device: torch.device):
    from .triton_attention import TritonAttention

    if not isinstance(backend, TritonAttention):
        raise ValueError("cuda_graphs: needs the Triton attention backend (attention_backend "
                         f"'triton', or 'auto' on CUDA); this engine resolved "
                         f"{config.attention_backend!r} to {type(backend).__name__}")
    from .cuda_graph import DecodeGraphs

    return DecodeGraphs(model, backend, config.max_num_seqs, config.max_model_len, device)
