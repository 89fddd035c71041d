"""The model contract: all that the engine, the model runner, the CUDA graphs, the KV pool sizing
and the draft model touch of a model.

A family subclasses `CausalLM` in one file (see llama.py, gemma2.py) and registers it under the
Hugging Face `config.model_type`(s) it serves. It provides:

- `__init__(config, max_model_len)`: its modules, built from the HF config with shared layers
  (layers/), parameters named as the checkpoint names them (fused ones excepted, see WEIGHTS);
  it sets `kv_layout`.
- `forward(input_ids [T], ctx) -> hidden [T, H]` over the step's flat token axis. `ctx`
  (rollout/forward_context.py) carries the positions, the attention call
  (`ctx.attend(q, k, v, layer, scale, softcap)`, which also stores the new K/V) and the
  rotary cos/sin (`ctx.rotary(rope, dtype)`, computed once per step and table).
- `compute_logits(hidden [N, H]) -> fp32 logits [N, V]`.
- `WEIGHTS`: how checkpoint tensor names map onto its parameters, declaratively (`WeightTable`).
  `check_weights`, `load_weights` and `expected_weight_names` are derived here from that table
  and from the shard sizes its fused linears hold (layers/linear.py).
- optionally `step_extras(ctx, rows)`: what a forward returns besides logits (MoE layers'
  routed experts), recorded by layers into `ctx.extras`.

The base class gives `config`, `vocab_size`, `dtype` (the weights') and `drop_tables` /
`build_tables` (derived tables such as RoPE cos/sin, dropped at sleep and rebuilt at wake).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

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


def sliding_windows(config, max_model_len: int) -> list[int | None]:
    """Each layer's window as the reference applies it. `layer_types` (Gemma 2/3; Qwen2/3 with
    use_sliding_window) names the sliding layers; without it `sliding_window` applies to every
    layer (Mistral, Phi-3). A window of at least max_model_len positions cuts nothing: None."""
    window = getattr(config, "sliding_window", None)
    if window is None or window >= max_model_len:
        return [None] * config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * config.num_hidden_layers
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
class WeightTable:
    """Checkpoint name -> our parameter. A name goes to the parameter of the same name, except
    that a module named in `fused` goes to its shard of the fused module, and names containing
    an `ignored` piece have no counterpart (derived buffers some checkpoints carry)."""

    fused: tuple[Fused, ...] = ()
    ignored: tuple[str, ...] = ("rotary_emb.",)

    def target(self, name: str) -> tuple[str, int | None]:
        """(our parameter name, shard index or None for the whole parameter)."""
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

    def step_extras(self, ctx, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row outputs besides logits for the flat rows `rows` of the last forward (what
        layers recorded in ctx.extras); dense models have none."""
        return {}

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    # --- derived tables (RoPE cos/sin): cheap to rebuild, so sleep drops them ----------------
    def _tables(self):
        return [m for m in self.modules() if hasattr(m, "build_table")]

    def drop_tables(self) -> None:
        for m in self._tables():
            m.drop_table()

    def build_tables(self, device: torch.device) -> None:
        """Rebuild the tables sleep dropped (those still there are kept)."""
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
                written.add(dest[1])
        return written

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (fused) parameters in place, so tensor addresses (and
        CUDA graphs captured against them) stay valid; returns the names written (a fused
        shard as `name[i]`). An unknown name or a wrong shape raises ValueError when reached:
        check_weights first to refuse before anything is copied."""
        params = dict(self.named_parameters())
        written: set[str] = set()
        for name, tensor in named_tensors:
            dest = self._destination(params, name, tensor.shape)
            if dest is not None:
                dest[0].copy_(tensor)
                written.add(dest[1])
        return written

    def expected_weight_names(self) -> set[str]:
        """What a complete load writes (for checking that a checkpoint covered everything)."""
        names = set()
        for name, _ in self.named_parameters():
            shards = self.WEIGHTS.num_shards(name)
            names.update([name] if shards is None else [f"{name}[{i}]" for i in range(shards)])
        return names

    def _destination(self, params: dict[str, nn.Parameter], name: str,
                     shape: torch.Size) -> tuple[torch.Tensor, str] | None:
        """The parameter (or fused shard of one) that the HF tensor `name` goes to, and the
        name it counts as written; None for tensors we do not keep."""
        if any(piece in name for piece in self.WEIGHTS.ignored):
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None  # tied: the embedding carries it
        target, shard = self.WEIGHTS.target(name)
        if target not in params:
            raise ValueError(f"weight {name!r}: no such parameter in this "
                             f"{self.config.model_type} model")
        dst = params[target]
        if shard is not None:
            sizes = self.get_submodule(target.rsplit(".", 1)[0]).shard_sizes
            dst = dst.narrow(0, sum(sizes[:shard]), sizes[shard])
        if dst.shape != shape:
            raise ValueError(f"weight {name!r}: shape {tuple(shape)}, expected "
                             f"{tuple(dst.shape)}")
        return dst, target if shard is None else f"{target}[{shard}]"
