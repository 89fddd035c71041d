"""The decoder container every family shares, and its KV layout."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..base import KVLayout, LayerKV
from .embedding import VocabParallelEmbedding
from .norm import RMSNorm


class Decoder(nn.Module):
    """The checkpoint's `model.` part: embed_tokens, layers (each with a `self_attn`), norm."""

    def __init__(self, config, make_layer: Callable[[int], nn.Module],
                 norm_offset: bool = False) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_offset)

    def kv_layout(self, windows: list[int | None]) -> KVLayout:
        """Per layer: its attention's KV heads (this rank's) and head dim, and `windows[i]`."""
        return KVLayout(tuple(LayerKV(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, w)
                              for layer, w in zip(self.layers, windows, strict=True)))
