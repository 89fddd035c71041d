"""Build the engine's model from an in-memory transformers model or a local checkpoint path."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch

from . import model_class


def checkpoint_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of a local checkpoint folder (safetensors, else PyTorch .bin)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors.torch import load_file

        for f in files:
            yield from load_file(f).items()
        return
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise ValueError(f"model: no *.safetensors or pytorch_model*.bin under {path!r}")
    for f in files:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


def build_model(config, max_model_len: int, dtype: torch.dtype, device: torch.device):
    """Allocate the engine's modules for `config` (weights uninitialised until loaded)."""
    cls = model_class(config)
    with torch.device(device):
        model = cls(config, max_model_len)
    # Only the weights take `dtype`: the RoPE tables stay fp32 and are cast per step, as the
    # reference casts its cos/sin.
    model.model.to(dtype=dtype)
    if model.lm_head is not None:
        model.lm_head.to(dtype=dtype)
    model.requires_grad_(False)
    return model.eval()


def load_into(model, named_tensors) -> None:
    """Load weights and check that the checkpoint covered every parameter."""
    written = model.load_weights(named_tensors)
    missing = model.expected_weight_names() - written
    if missing:
        raise ValueError(f"load_weights: the checkpoint lacks {len(missing)} tensors, e.g. "
                         f"{sorted(missing)[:3]}")
