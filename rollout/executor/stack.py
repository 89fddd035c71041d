"""A model with the KV machinery that serves it: pool, prefix cache, slot table, KV manager,
backends (attention, sampler, acceptance: rollout/ops/backend.py), runner, and the parking of its
weights for sleep. The engine holds one for its model (and a scheduler over its KV manager);
the draft-model drafter holds another for the draft. The model is used through its contract
(rollout/models/base.py) only: KV layout, dtype, tables, forward, logits."""

from __future__ import annotations

import torch

from ..attention.registry import attention_name, make_attention
from ..colocation import host_heap
from ..colocation.device_memory import tensor_bytes
from ..colocation.parking import WeightParking, separate_host_memory
from ..config import EngineConfig
from ..journal import Journal
from ..kv.manager import KVManager
from ..kv.pool import KVPool, kv_bytes_per_token, size_pool
from ..kv.prefix_cache import make_prefix_cache
from ..kv.slot_table import SlotTable
from ..models.layers.lora import LoraWeights
from ..models.layers.packed_linear import Projection
from ..ops.backend import resolve_backend
from ..ops.op import Dispatched
from ..sample.sampler import DRAW, Sampler
from .cuda_graph import DecodeGraphs
from .runner import ModelRunner


def plain_tensors(function):
    """`function` with autograd off and outside inference mode, whatever mode its caller is in:
    what it allocates and keeps is made of plain tensors. An eval script or a trainer's rollout
    block may build or wake the engine under torch.inference_mode, whose inference tensors the
    engine's later calls outside it could not update in place (the pool's free list, the slot
    table, the weights update_weights copies into): torch refuses, and the failed step's rollback
    with it."""
    return torch.inference_mode(False)(torch.no_grad()(function))


class ModelStack:
    def __init__(self, model, config: EngineConfig, num_slots: int, device: torch.device,
                 journal: Journal) -> None:
        self.model, self.device = model, device
        if device.type == "cpu" and config.keep_cpu_heap:
            host_heap.keep_freed_blocks()
        layout = model.kv_layout
        self.pool = KVPool(layout.num_layers, num_slots, layout.kv_heads, layout.head_dim,
                           model.dtype, device, model.slot_extras())
        self.table = SlotTable(config.max_num_seqs, config.max_model_len, device)
        # Page size 1 and every slot kept: sliding-window layers mask what lies outside their
        # window, global layers need the whole context anyway.
        cache = make_prefix_cache(config.enable_prefix_caching, device)
        self.kv = KVManager(self.pool, cache, self.table, journal)
        self.backend = resolve_backend(config.backend, device, config.pack_cpu_weights,
                                       config.batch_invariant)
        model.use_backend(self.backend)
        if config.lm_head_dtype == torch.float32 and model.dtype != torch.float32:
            model.head.compute_in_float32(self.backend)
        model.pack_weights()
        self.attention = make_attention(self.backend, model.dtype, self.pool, layout.windows)
        self.sampler = Sampler(self.backend)
        self.graphs = None
        if config.cuda_graphs:
            if not self.backend.cuda_graphs:
                raise ValueError(f"cuda_graphs: needs the Triton attention backend (backend "
                                 f"'triton', or 'auto' on CUDA); this engine resolved "
                                 f"{config.backend!r} to {self.backend.name!r}")
            self.graphs = DecodeGraphs(model, self.attention, config.max_num_seqs,
                                       config.max_model_len, device)
        self.runner = ModelRunner(model, self.attention, self.table, device, self.graphs)
        self.parking = WeightParking(model, device,
                                     separate_host_memory(config.extra, device))

    def implementations(self) -> dict[str, str]:
        """Which implementation each op runs (rollout/ops/backend.py): the attention backend,
        the sampler, every dispatched layer kind, and the packing of the decoder's projections and
        of the LM head."""
        out = {"backend": self.backend.name,
               "attention": attention_name(self.backend, self.model.dtype),
               "sample": self.backend.choose(DRAW.implementations, torch.float32)}
        # the head has its own key: its packing can differ (EngineConfig.lm_head_dtype), and
        # one key for both showed whichever came last, hiding the decoder's
        head = {id(m) for m in self.model.head.modules()}
        for module in self.model.modules():
            if isinstance(module, Dispatched):
                out[type(module).__name__] = module.implementation
            elif isinstance(module, Projection):
                packing = module.packing
                key = "lm_head" if id(module) in head else "projection"
                out[key] = "torch" if packing is None else packing.kind
            elif isinstance(module, LoraWeights):  # an unmerged LoRA adapter (rollout/lora/)
                out["lora"] = module.implementation
        return out

    def sleep(self, level: int) -> None:
        """Drop the KV pool (the tree empties with it) and park the weights (rollout/colocation/parking.py).
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

    def memory_held(self) -> int:
        """Bytes of tensors this stack holds on its device: the weights and their packed
        copies, the KV pool with its per-slot extras and free list, and the slot table (the
        weights parked in host memory are not on the device)."""
        pool = self.pool
        tensors = [*self.model.parameters(), *self.model.buffers(), pool.buffer,
                   *pool.extras.values(), pool.free_slots() if pool.is_allocated else None,
                   self.table.table]
        return (tensor_bytes(t for t in tensors if t is not None and t.device == self.device)
                + self.model.derived_bytes())

    @plain_tensors
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



def pool_slots(model, config: EngineConfig, dtype: torch.dtype, device: torch.device,
               agree=None, draft=None) -> int:
    """How many KV slots `model`'s pool gets under `config` (rollout/kv/pool.py size_pool;
    `agree`: the ranks' settling on one size). A `draft` model's pool has as many slots (it
    tracks the same sequences): a slot costs both pools' bytes, or the draft's pool lay
    outside every memory check (an out-of-memory error at build, a fraction overrun)."""
    per_token = sum(slot_bytes(m, dtype) for m in (model, draft) if m is not None)
    return size_pool(config.kv_cache_tokens, config.kv_memory_fraction, config.max_model_len,
                     config.max_num_seqs, per_token, device, agree)


def slot_bytes(model, dtype: torch.dtype) -> int:
    """What one slot of `model`'s KV pool costs: K and V in every layer, and its extras."""
    layout = model.kv_layout
    return kv_bytes_per_token(layout.num_layers, layout.kv_heads, layout.head_dim, dtype,
                              model.slot_extras())
