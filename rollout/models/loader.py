"""Build the engine's model from an in-memory transformers model or a local checkpoint path."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch

from ..config import EngineConfig
from ..weights import is_peft, model_tensors, unwrap
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


def resolve_model(model, config: EngineConfig, tokenizer):
    """(hf_config, named weights, device, dtype, tokenizer) for an in-memory model or a path."""
    if isinstance(model, str):
        from transformers import AutoConfig, AutoTokenizer

        hf_config = AutoConfig.from_pretrained(model)
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        default = getattr(hf_config, "dtype", None) if device.type == "cuda" else None
        dtype = config.dtype or (default if isinstance(default, torch.dtype) else torch.float32)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(model)
        return hf_config, checkpoint_tensors(model), device, dtype, tokenizer
    inner = unwrap(model) if isinstance(model, torch.nn.Module) else model
    if not hasattr(inner, "config") or not hasattr(inner, "named_parameters"):
        raise ValueError("model must be a transformers PreTrainedModel (possibly DDP/PEFT "
                         "wrapped) or a local path")
    param = next(inner.parameters())
    device = torch.device(config.device or param.device)
    # One spelling per device, so tensors on it compare equal: distributed CPU runs hand out
    # "cpu:0" (!= "cpu"), and a bare "cuda" means the current GPU.
    if device.type == "cpu":
        device = torch.device("cpu")
    elif device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    hf_config = inner.get_base_model().config if is_peft(inner) else inner.config
    return hf_config, model_tensors(model), device, config.dtype or param.dtype, tokenizer


def eos_token_ids(model, hf_config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None),
               getattr(getattr(model, "generation_config", None), "eos_token_id", None),
               getattr(tokenizer, "eos_token_id", None)]
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
