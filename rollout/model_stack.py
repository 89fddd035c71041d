"""A model with the KV machinery that serves it: pool, radix cache, slot table, scheduler,
attention backend, runner, and the parking of its weights for sleep. The engine holds one for
its model; the draft-model drafter holds another for the draft."""

from __future__ import annotations

import torch

from .attention import make_backend
from .config import EngineConfig
from .kv_pool import KVPool
from .model_runner import ModelRunner
from .radix_cache import RadixCache
from .scheduler import Scheduler
from .sleep import WeightParking
from .slot_table import SlotTable


class ModelStack:
    def __init__(self, model, config: EngineConfig, num_slots: int,
                 device: torch.device) -> None:
        self.model, self.device = model, device
        self.pool = KVPool(model.config.num_hidden_layers, num_slots, model.num_kv_heads,
                           model.head_dim, model.model.embed_tokens.weight.dtype, device)
        self.cache = RadixCache(self.pool.free, device, enabled=config.enable_prefix_caching)
        self.table = SlotTable(config.max_num_seqs, config.max_model_len, device)
        self.scheduler = Scheduler(config, self.pool, self.cache, self.table)
        self.backend = make_backend(config.attention_backend, self.pool)
        self.graphs = None
        if config.cuda_graphs:
            self.graphs = decode_graphs(model, self.backend, config, device)
        self.runner = ModelRunner(model, self.backend, self.table, device, self.graphs)
        self.parking = WeightParking(model, device)

    def sleep(self, level: int) -> None:
        """Drop the KV pool (the tree empties with it) and park the weights (see sleep.py).
        On a stack asleep at level 1, sleep(2) deepens in place: nothing is allocated."""
        if self.graphs is not None:
            self.graphs.release()
        self.cache.reset()
        self.pool.release()
        self.table.release()
        self.model.rope.release()
        self.parking.park(level)

    def wake_up(self) -> None:
        self.parking.restore()
        self.model.rope.build(self.device)
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
