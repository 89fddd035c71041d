"""The model contract: all that the engine, the model runner, the CUDA graphs, the KV pool sizing
and the draft model touch of a model.

A family subclasses `CausalLM` in one file (see llama.py, gemma2.py) and registers it under the
Hugging Face `config.model_type`(s) it serves. It provides:

- `__init__(config, max_model_len)`: its modules, built from the HF config with shared layers
  (layers/), parameters named as the checkpoint names them (fused ones excepted, see WEIGHTS);
  it sets `kv_layout` (its windows by `window_rule`: which layers the reference slides
  `sliding_window` over).
- `forward(input_ids [T], ctx) -> hidden [T, H]` over the step's flat token axis. `ctx`
  (rollout/executor/context.py) carries the positions, the attention call
  (`ctx.attend(q, k, v, layer, scale, softcap)`, which also stores the new K/V) and the
  rotary cos/sin (`ctx.rotary(rope, dtype)`, computed once per step and table).
- `compute_logits(hidden [N, H]) -> fp32 logits [N, V]`.
- `WEIGHTS`: how checkpoint tensor names map onto its parameters, declaratively (`WeightTable`).
  `check_weights`, `load_weights` and `expected_weight_names` are derived here from that table
  and from the shard sizes its fused linears hold (layers/linear.py).
- optionally `slot_extras()`: what the KV pool keeps per slot beside K/V, written by layers
  with `ctx.store_slot_values` (MoE: each MoE layer's routed experts, ROUTED_EXPERTS), and
  `use_backend(backend)`: layers with an implementation per backend (rollout/ops/op.py
  Dispatched, and the projections' packing) take the engine's (rollout/ops/backend.py).

The base class gives `config`, `vocab_size`, `dtype` (the weights') and `drop_tables` /
`build_tables` (derived tables such as RoPE cos/sin, dropped at sleep and rebuilt at wake; the
CPU projections' packed weights, dropped at sleep and packed again at first use).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..parallel import Concat, Slice

# The per-slot extra (CausalLM.slot_extras) of MoE models: the expert ids each MoE layer chose
# for the token in the forward that computed its K/V, int16 [num MoE layers, top_k].
ROUTED_EXPERTS = "routed_experts"

# The attribute of a projection that holds an unmerged LoRA adapter (layers/lora.py LoraWeights):
# its parameters are the adapter's, loaded by rollout/lora/, not by load_weights.
LORA_MODULE = "lora"


def is_lora_parameter(name: str) -> bool:
    """A parameter of some projection's LoraWeights, by its model-wide name."""
    return f".{LORA_MODULE}." in f".{name}"


# --- registry -------------------------------------------------------------------------------
MODEL_REGISTRY: dict[str, type[CausalLM]] = {}


def register(*model_types: str) -> Callable[[type[CausalLM]], type[CausalLM]]:
    """Class decorator: serve these HF `config.model_type`s with the class."""

    def add(cls: type[CausalLM]) -> type[CausalLM]:
        for kind in model_types:
            if kind in MODEL_REGISTRY:
                raise ValueError(f"model_type {kind!r} is registered twice")
            MODEL_REGISTRY[kind] = cls
        return cls

    return add


# --- KV layout ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerKV:
    kv_heads: int
    head_dim: int
    # Sliding window as Hugging Face counts it: a query at position p sees keys p - window < j
    # <= p (the window latest positions, itself included). None: every earlier position.
    window: int | None = None


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerKV, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_heads(self) -> int:
        return self._uniform("kv_heads")

    @property
    def head_dim(self) -> int:
        return self._uniform("head_dim")

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(layer.window for layer in self.layers)

    def _uniform(self, field: str) -> int:
        # The pool is one allocation viewed per layer: one shape for all of them.
        values = {getattr(layer, field) for layer in self.layers}
        if len(values) != 1:
            raise ValueError(f"the KV pool needs one {field} for every layer, got {sorted(values)}")
        return values.pop()


# Which layers a family's reference slides `config.sliding_window` over (CausalLM.window_rule):
# the layers `layer_types` marks (Gemma 2/3, Qwen2/3), every layer whatever `layer_types` says
# (Mistral, Mixtral, Phi-3, Qwen3-MoE), or none (Llama keeps the attribute and ignores it).
WINDOW_BY_LAYER_TYPE, WINDOW_EVERY_LAYER, WINDOW_NONE = "layer_types", "every_layer", "none"


def sliding_windows(config, max_model_len: int, rule: str) -> list[int | None]:
    """Each layer's window as the reference applies it under `rule` (above). A window of at
    least max_model_len positions cuts nothing: None."""
    window = getattr(config, "sliding_window", None)
    if window is None or window >= max_model_len or rule == WINDOW_NONE:
        return [None] * config.num_hidden_layers
    if rule == WINDOW_EVERY_LAYER:
        return [window] * config.num_hidden_layers
    types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


# --- weight table ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Fused:
    """Checkpoint modules `theirs` fill, in order, the shards of our module `ours` (a
    MergedLinear: its weight and bias are theirs stacked along dim 0)."""

    ours: str
    theirs: tuple[str, ...]


# The usual Hugging Face layout: separate q/k/v and gate/up projections, loaded into the shards
# of our fused `qkv_proj` and `gate_up_proj`. A checkpoint that stores them fused already
# (Phi-3) maps by name, with no entry.
SPLIT_QKV = Fused("qkv_proj", ("q_proj", "k_proj", "v_proj"))
SPLIT_GATE_UP = Fused("gate_up_proj", ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class Stacked:
    """MoE experts stored stacked: our parameter `<module>.<ours>` is [E, ...], and checkpoints
    that name each expert (`<module>.<e>.<theirs>.weight`) fill slice e of it in place, or,
    with `shard`, that shard of slice e along its dim 0 (sizes from the module's
    `shard_sizes[ours]`). A checkpoint holding the stacked tensor (transformers 5) maps by name."""

    module: str  # "experts"
    theirs: str  # "gate_proj", Mixtral's "w1"
    ours: str  # "gate_up_proj"
    shard: int | None = None

    @property
    def pattern(self) -> re.Pattern:
        module, theirs = re.escape(self.module), re.escape(self.theirs)
        return re.compile(rf"\.{module}\.(\d+)\.{theirs}\.weight$")


@dataclass(frozen=True)
class WeightTable:
    """Checkpoint name -> our parameter. A name goes to the parameter of the same name, except
    that pieces in `renamed` are replaced first (Mixtral's `.block_sparse_moe.` -> `.mlp.`), a
    per-expert name in `stacked` goes to its expert's slice of the stacked parameter, a module
    named in `fused` goes to its shard of the fused module, and names containing an `ignored`
    piece have no counterpart (derived buffers some checkpoints carry)."""

    fused: tuple[Fused, ...] = ()
    ignored: tuple[str, ...] = ("rotary_emb.",)
    stacked: tuple[Stacked, ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()

    def _renamed(self, name: str) -> str:
        for old, new in self.renamed:
            name = name.replace(old, new)
        return name

    def expert(self, name: str) -> tuple[str, int, int | None] | None:
        """(our stacked parameter, expert index, shard or None) for a per-expert checkpoint
        name; None for any other name."""
        name = self._renamed(name)
        for s in self.stacked:
            found = s.pattern.search(name)
            if found:
                return (f"{name[:found.start()]}.{s.module}.{s.ours}", int(found.group(1)),
                        s.shard)
        return None

    def stacked_shards(self, param_name: str) -> list[int | None] | None:
        """The shards per expert of a stacked parameter ([None]: each expert's slice is one
        tensor), or None when the parameter is not stacked."""
        shards = [s.shard for s in self.stacked if param_name.endswith(f".{s.module}.{s.ours}")]
        return sorted(shards, key=lambda s: -1 if s is None else s) if shards else None

    def target(self, name: str) -> tuple[str, int | None]:
        """(our parameter name, shard index or None for the whole parameter); per-expert names
        are `expert`'s."""
        name = self._renamed(name)
        for f in self.fused:
            for shard, theirs in enumerate(f.theirs):
                piece = f".{theirs}."
                if piece in name:
                    return name.replace(piece, f".{f.ours}."), shard
        return name, None

    def num_shards(self, param_name: str) -> int | None:
        """How many checkpoint tensors fill our parameter; None when one fills it whole."""
        module = param_name.split(".")[-2] if "." in param_name else ""
        for f in self.fused:
            if module == f.ours:
                return len(f.theirs)
        return None


# --- the contract ---------------------------------------------------------------------------
class CausalLM(nn.Module):
    WEIGHTS: ClassVar[WeightTable] = WeightTable()
    # Whether the reference's default RoPE reads `partial_rotary_factor` (Phi-3's does; the
    # other families' rotate the whole head whatever the config holds).
    PARTIAL_ROTARY: ClassVar[bool] = False
    kv_layout: KVLayout

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def head(self):
        """The projection compute_logits multiplies by (a layers.VocabParallelEmbedding: the LM
        head, or the embedding it is tied to)."""
        raise NotImplementedError

    @classmethod
    def window_rule(cls, config) -> str:
        """Which layers `config.sliding_window` applies to in the reference: WINDOW_*."""
        raise NotImplementedError

    def slot_extras(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of what the KV pool keeps per slot beside K/V, written in the
        forward by `ctx.store_slot_values` at the tokens' slots, so it lives exactly as long as
        their K/V (prefix cache, preemption, speculation). MoE models: ROUTED_EXPERTS, the
        expert ids [num MoE layers, top_k] each MoE layer chose for the token. Dense: none."""
        return {}

    def use_backend(self, backend) -> None:
        """Every layer with an implementation per backend takes the engine's
        (rollout/ops/backend.py), for the model's dtype."""
        for module in self.modules():
            if module is not self and hasattr(module, "use_backend"):
                module.use_backend(backend, self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    # --- derived tables (RoPE cos/sin, packed weights): cheap to rebuild, so sleep drops them -
    def _tables(self):
        return [m for m in self.modules() if hasattr(m, "build_table")]

    def _projections(self):
        """Modules that may hold packed weights (layers/packed_linear.py Projection)."""
        return [m for m in self.modules() if hasattr(m, "drop_derived")]

    def drop_tables(self) -> None:
        for m in self._tables():
            m.drop_table()
        for m in self._projections():  # packed again at their next use, from the weights then
            m.drop_derived()

    def pack_weights(self) -> None:
        """Pack every projection's weight as it is now (CPU; see drop_tables)."""
        for m in self._projections():
            m.pack()

    def derived_bytes(self) -> int:
        """Bytes of the packed weights (CPU projections; packed_linear.py) held now."""
        return sum(m.derived_bytes() for m in self._projections())

    def build_tables(self, device: torch.device) -> None:
        """Build the tables: at construction (on the device the model was allocated on), and
        again at wake-up for those sleep dropped (those still there are kept)."""
        for m in self._tables():
            if not m.has_table:
                m.build_table(device)

    # --- weights ----------------------------------------------------------------------------
    def check_weights(self, named_shapes: Iterable[tuple[str, torch.Size]]) -> set[str]:
        """What load_weights would write for tensors of these HF names and shapes, reading and
        copying nothing, so that a bad name or shape (ValueError) is refused before any weight
        changes."""
        params = dict(self.named_parameters())
        written: set[str] = set()
        for name, shape in named_shapes:
            dest = self._destination(params, name, shape)
            if dest is not None:
                written.update(dest[1])
        return written

    def rank_parts(self, named_shapes: Iterable[tuple[str, torch.Size]]
                   ) -> dict[str, Slice | Concat | None]:
        """HF name -> the part of that full tensor this rank keeps under tensor parallelism
        (None: all of it); names the model does not keep are left out. update_weights cuts its
        sources with it before any host-to-device copy or DTensor exchange
        (rollout/parallel/reshard.py)."""
        params = dict(self.named_parameters())
        parts = {}
        for name, shape in named_shapes:
            dest = self._destination(params, name, shape)
            if dest is not None:
                parts[name] = dest[2]
        return parts

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     local: bool = False, copy=None) -> set[str]:
        """Copy HF-named tensors into our (fused) parameters in place, so tensor addresses (and
        CUDA graphs captured against them) stay valid; returns the names written (a fused
        shard as `name[i]`, an expert's slice of a stacked parameter as `name[e]`, a shard of it
        as `name[e][i]`; a whole stacked tensor counts as all of them). `local`: the tensors
        are this rank's parts already (`rank_parts`), not full ones. An unknown name or a
        wrong shape raises ValueError when reached: check_weights first to refuse before
        anything is copied. `copy(name, dst, src)`: how each tensor goes in (update_weights
        checks each copy: rollout/colocation/checksum.py); dst.copy_(src) by default."""
        params = dict(self.named_parameters())
        written: set[str] = set()
        for name, tensor in named_tensors:
            dest = self._destination(params, name, tensor.shape, local)
            if dest is not None:
                dst, pieces, cut = dest
                src = tensor if cut is None or local else cut.take(tensor)
                if copy is None:
                    dst.copy_(src)
                else:
                    copy(name, dst, src)
                written.update(pieces)
        return written

    def expected_weight_names(self) -> set[str]:
        """What a complete load writes (for checking that a checkpoint covered everything)."""
        names = set()
        for name, param in self.named_parameters():
            if not is_lora_parameter(name):  # adapters are loaded by rollout/lora/, not here
                names.update(self._pieces(name, param))
        return names

    def _pieces(self, name: str, param: torch.Tensor) -> list[str]:
        """The names a write of the whole parameter counts as: the finest pieces a checkpoint
        may fill it by (shards of a fused parameter, experts' slices of a stacked one)."""
        stacked = self.WEIGHTS.stacked_shards(name)
        if stacked is not None:
            return [f"{name}[{e}]" if s is None else f"{name}[{e}][{s}]"
                    for e in range(param.shape[0]) for s in stacked]
        shards = self.WEIGHTS.num_shards(name)
        return [name] if shards is None else [f"{name}[{i}]" for i in range(shards)]

    def _destination(self, params: dict[str, nn.Parameter], name: str, shape: torch.Size,
                     local: bool = False
                     ) -> tuple[torch.Tensor, list[str], Slice | Concat | None] | None:
        """The parameter (or the fused shard, or the expert's slice, of one) that the HF tensor
        `name` goes to, the names it counts as written, and the part of the tensor this rank
        keeps under tensor parallelism (None: all of it); None for tensors we do not keep.
        `shape` is the full tensor's, or with `local` the rank's part's."""
        if any(piece in name for piece in self.WEIGHTS.ignored):
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None  # tied: the embedding carries it
        located = self.WEIGHTS.expert(name)
        if located is not None:
            target, expert, shard = located
            dst = self._parameter(params, name, target)
            if expert >= dst.shape[0]:
                raise ValueError(f"weight {name!r}: expert {expert}, but this model has "
                                 f"{dst.shape[0]}")
            dst, written = dst[expert], f"{target}[{expert}]"
            if shard is not None:
                module, attr = target.rsplit(".", 1)
                sizes = self.get_submodule(module).shard_sizes[attr]
                dst, written = dst.narrow(0, sum(sizes[:shard]), sizes[shard]), \
                    f"{written}[{shard}]"
            pieces = [written]
        else:
            target, shard = self.WEIGHTS.target(name)
            dst = self._parameter(params, name, target)
            if shard is not None:
                sizes = self.get_submodule(target.rsplit(".", 1)[0]).shard_sizes
                dst = dst.narrow(0, sum(sizes[:shard]), sizes[shard])
            pieces = (self._pieces(target, dst) if shard is None
                      else [f"{target}[{shard}]"])
        cut = self._tp_slice(target, shard)
        if cut is not None:
            # The last rank's vocabulary rows past V are padding that no checkpoint fills.
            dst = dst.narrow(cut.dim, 0, cut.length)
        expected = dst.shape if cut is None or local else cut.full_shape(dst.shape)
        if expected != shape:
            raise ValueError(f"weight {name!r}: shape {tuple(shape)}, expected "
                             f"{tuple(expected)}")
        return dst, pieces, cut

    def _tp_slice(self, target: str, shard: int | None) -> Slice | Concat | None:
        """How this rank's part of parameter `target` (shard `shard` of it) is cut from the
        checkpoint's tensor (rollout/parallel/shard.py); None when it keeps the tensor whole."""
        module, attr = target.rsplit(".", 1)
        tp_slice = getattr(self.get_submodule(module), "tp_slice", None)
        return None if tp_slice is None else tp_slice(attr, shard)

    def _parameter(self, params: dict[str, nn.Parameter], name: str,
                   target: str) -> nn.Parameter:
        if target not in params:
            raise ValueError(f"weight {name!r}: no such parameter in this "
                             f"{self.config.model_type} model")
        return params[target]
