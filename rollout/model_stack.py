"""A model with the KV machinery that serves it: pool, prefix cache, slot table, KV manager,
backends (attention, sampler, acceptance: rollout/backends.py), runner, and the parking of its
weights for sleep. The engine holds one for its model (and a scheduler over its KV manager);
the draft-model drafter holds another for the draft. The model is used through its contract
(rollout/models/base.py) only: KV layout, dtype, tables, forward, logits."""

from __future__ import annotations

import torch

from . import cpu_heap
from .backends import resolve_backends
from .config import EngineConfig
from .cuda_graph import DecodeGraphs
from .journal import Journal
from .kv_manager import KVManager
from .kv_pool import KVPool
from .model_runner import ModelRunner
from .no_prefix_cache import make_prefix_cache
from .sleep import WeightParking, separate_host_memory
from .slot_table import SlotTable


class ModelStack:
    def __init__(self, model, config: EngineConfig, num_slots: int, device: torch.device,
                 journal: Journal) -> None:
        self.model, self.device = model, device
        if device.type == "cpu" and config.keep_cpu_heap:
            cpu_heap.keep_freed_blocks()
        layout = model.kv_layout
        self.pool = KVPool(layout.num_layers, num_slots, layout.kv_heads, layout.head_dim,
                           model.dtype, device, model.slot_extras())
        self.table = SlotTable(config.max_num_seqs, config.max_model_len, device)
        # Page size 1 and every slot kept: sliding-window layers mask what lies outside their
        # window, global layers need the whole context anyway.
        cache = make_prefix_cache(config.enable_prefix_caching, device)
        self.kv = KVManager(self.pool, cache, self.table, journal)
        self.backends = resolve_backends(config.backend, device, config.pack_cpu_weights,
                                         config.native_cpu_kernels)
        model.use_backends(self.backends)
        model.pack_weights()
        self.backend = self.backends.attention(self.pool, layout.windows)
        self.graphs = None
        if config.cuda_graphs:
            if not self.backends.cuda_graphs:
                raise ValueError(f"cuda_graphs: needs the Triton attention backend (backend "
                                 f"'triton', or 'auto' on CUDA); this engine resolved "
                                 f"{config.backend!r} to {self.backends.name!r}")
            self.graphs = DecodeGraphs(model, self.backend, config.max_num_seqs,
                                       config.max_model_len, device)
        self.runner = ModelRunner(model, self.backend, self.table, device, self.graphs)
        self.parking = WeightParking(model, device,
                                     separate_host_memory(config.extra, device))

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
        self.model.drop_tables()
        self.parking.park(level)

    def wake_up(self) -> None:
        """Bring back what sleep dropped; what a failed sleep left in place is kept."""
        # Weights a level-2 sleep dropped come back uninitialised: packed after update_weights.
        weights_kept = not self.parking.dropped_any
        self.parking.restore()
        self.model.build_tables(self.device)
        if weights_kept:
            self.model.pack_weights()
        if not self.pool.is_allocated:
            self.kv.reset()
            self.pool.allocate()
            self.table.allocate()

