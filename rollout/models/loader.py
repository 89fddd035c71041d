"""Build the engine's model from an in-memory transformers model or a checkpoint (a local
folder or a hub id)."""

from __future__ import annotations

import dataclasses
import os

import torch

from ..colocation.weights import check_tied_embeddings, model_tensors, unwrap
from ..config import DEFAULT_MAX_MODEL_LEN, EngineConfig, as_dtype
from ..parallel import SINGLE, TensorParallel, building_for
from . import model_class
from .base import CausalLM
from .checkpoint import has_tokenizer, tensors_of, untie_a_distinct_head, weight_files
from .layers.rotary import adopt_rounded_frequencies, context_length, context_limit


def check_unquantized(hf_config, name: str) -> None:
    """ValueError for a quantized model (transformers' config.quantization_config: FP8, GPTQ,
    AWQ checkpoints, bitsandbytes models): the engine's layers multiply plain weights, and a
    copy of packed or scaled ones (their scales ignored) would serve other values."""
    quantization = getattr(hf_config, "quantization_config", None)
    if not quantization:
        return
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    method = getattr(method, "value", method)  # transformers' QuantizationMethod is an Enum
    raise ValueError(f"{name}: quantization_config (quant_method {method!r}): the engine serves "
                     "unquantized weights (float32, bfloat16, float16) only; give it the "
                     "model's unquantized checkpoint, or the model after model.dequantize()")


def fit_max_model_len(config: EngineConfig, hf_config) -> EngineConfig:
    """`config` with a max_model_len: DEFAULT_MAX_MODEL_LEN where it was left None, or the
    model's context where that is shorter."""
    if config.max_model_len is not None:
        return config
    length = min(DEFAULT_MAX_MODEL_LEN, context_length(hf_config) or DEFAULT_MAX_MODEL_LEN)
    return dataclasses.replace(config, max_model_len=length)


def check_context(config, max_model_len: int) -> None:
    """ValueError for a max_model_len past the context `config` declares (as vLLM refuses it):
    positions beyond it are ones the model's RoPE was neither trained nor scaled for, and its
    outputs there would be garbage, silently. Past the length up to which a length-dependent
    scaling (dynamic NTK, LongRoPE) is one set of frequencies, the engine's table, built once,
    would differ from the reference for the sequences on the other side (rotary.py). The
    target's only: a draft model of a shorter context (TinyLlama's 2048 for a 4096 target)
    drafts worse past it, and verification keeps every output the target's."""
    limit = context_limit(config)
    if limit is None or max_model_len <= limit[0]:
        return
    length, reason = limit
    raise ValueError(
        f"max_model_len: {max_model_len} is more than the model's context, {length} tokens "
        f"({reason}); lower max_model_len to {length} at most, or give the model a config "
        "whose RoPE scaling reaches it (rope_parameters: linear or yarn with a factor)")


def build_model(config, max_model_len: int, dtype: torch.dtype, device: torch.device,
                tp: TensorParallel = SINGLE, source=None) -> CausalLM:
    """Allocate the engine's modules for `config` (weights uninitialised until loaded), this
    rank's part of them under tensor parallelism `tp`. `source`: the live transformers model
    (or a path) they are built for, whose rounded rotary frequencies they take."""
    cls = model_class(config)
    # Constructed on the meta device, where nothing is allocated or initialised: the modules'
    # default init (nn.Linear's kaiming, ...) would draw from torch's generators, which a
    # trainer seeded for its own dropout and shuffles, and took longer than the load that
    # overwrites it; and weights made in float32 then cast peaked at 3x a bf16 model's bytes.
    with torch.device("meta"), building_for(tp):
        model = cls(config, max_model_len)
    if isinstance(source, torch.nn.Module):
        adopt_rounded_frequencies(model, source)
    # Only the weights take `dtype`: the RoPE tables stay fp32 and are cast per step, as the
    # reference casts its cos/sin.
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.to_empty(device=device)
    model.build_tables(device)  # computed, not loaded: on the device now, as at wake-up
    model.requires_grad_(False)
    return model.eval()


def load_into(model, named_tensors) -> None:
    """Load weights and check that the checkpoint covered every parameter."""
    written = model.load_weights(named_tensors)
    missing = model.expected_weight_names() - written
    if missing:
        raise ValueError(f"load_weights: the checkpoint lacks {len(missing)} tensors, e.g. "
                         f"{sorted(missing)[:3]}")


def resolve_model(model, config: EngineConfig, tokenizer, name: str = "model"):
    """(hf_config, named weights, device, dtype, tokenizer) for an in-memory model, a path or a
    hub id; `name`: the field in a refusal's message."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, str):
        from transformers import AutoConfig, AutoTokenizer

        # A path that is not there would be looked up as a hub id (and refused as a badly
        # formed one): say what is missing.
        if model.startswith(("/", "./", "../", "~")):
            if not os.path.isdir(os.path.expanduser(model)):
                raise ValueError(f"{name}: no checkpoint directory at {model!r}")
            model = os.path.expanduser(model)

        device = _check_device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        hf_config = AutoConfig.from_pretrained(model)
        check_unquantized(hf_config, name)
        default = getattr(hf_config, "dtype", None) if device.type == "cuda" else None
        dtype = config.dtype or (default if isinstance(default, torch.dtype) else torch.float32)
        if tokenizer is None and has_tokenizer(model):
            tokenizer = AutoTokenizer.from_pretrained(model)
        files = weight_files(model, name)
        untie_a_distinct_head(hf_config, files)
        return hf_config, tensors_of(files), device, _model_dtype(dtype), tokenizer
    inner = unwrap(model) if isinstance(model, torch.nn.Module) else model
    param = next(inner.parameters(), None) if hasattr(inner, "parameters") else None
    if not hasattr(inner, "config") or param is None:
        raise ValueError(f"{name} must be a transformers PreTrainedModel (possibly DDP/PEFT "
                         f"wrapped) or a local path, got {type(model).__name__}")
    # A model built on the meta device, or offloaded there in part (accelerate's device_map),
    # holds no values to copy: refused here, not as a device "meta" or in the copy.
    if any(p.is_meta for p in inner.parameters()):
        raise ValueError(f"{name}: some of its parameters are on the meta device, with no "
                         "values; load its weights (from_pretrained without offloading) first")
    device = _check_device(config.device or param.device)
    hf_config = inner.config  # unwrap peels PEFT too
    check_unquantized(hf_config, name)
    check_tied_embeddings(model, bool(getattr(hf_config, "tie_word_embeddings", False)), name)
    return (hf_config, model_tensors(model), device, _model_dtype(config.dtype or param.dtype),
            tokenizer)


def _check_device(device: torch.device | str) -> torch.device:
    """The device, if this process has it, spelled one way so tensors on it compare equal:
    distributed CPU runs hand out "cpu:0" (!= "cpu"), and a bare "cuda" means the current GPU.
    Checked before anything is allocated on it."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"device must be cpu or cuda, got {device}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"device is {device}, but CUDA is not available in this process")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= count:
        raise ValueError(f"device is {device}, but this process sees {count} CUDA device(s): "
                         f"cuda:0 to cuda:{count - 1}")
    return device


def _model_dtype(dtype: torch.dtype) -> torch.dtype:
    # The model's (or checkpoint's) own dtype when EngineConfig.dtype is None.
    return as_dtype(dtype, "dtype (EngineConfig.dtype, else the model's)")


def eos_token_ids(model, hf_config, tokenizer) -> frozenset[int]:
    """Every id that ends a sample: the config's, the generation config's (a checkpoint's
    generation_config.json often names more, e.g. an instruct model's end-of-turn) and the
    tokenizer's."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None),
               getattr(_generation_config(model), "eos_token_id", None),
               getattr(tokenizer, "eos_token_id", None)]
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def _generation_config(model):
    """An in-memory model's generation config, or a checkpoint's (None without one)."""
    if not isinstance(model, (str, os.PathLike)):
        return getattr(model, "generation_config", None)
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(os.path.expanduser(os.fspath(model)))
    except OSError:  # no generation_config.json
        return None
