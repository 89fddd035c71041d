"""A checkpoint's files as transformers' from_pretrained finds them: its weight files (a local
folder or a hub id), its tokenizer, and its tied pair as the files hold it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch


# The weight files transformers' from_pretrained reads, the first found: the single file or a
# sharded checkpoint's index (tensor name -> file), safetensors before PyTorch's. Other files
# beside them are another format's or another model's (Mistral's Hub repositories ship
# `consolidated.safetensors` with their own tensor names; a PEFT adapter may be saved into the
# same folder), and transformers never reads them.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


# The tied pair (tie_word_embeddings) under its checkpoint names, in every family served.
HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def checkpoint_tensors(path: str, name: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of a checkpoint (a local folder or a hub id), read lazily from the
    files transformers reads (found now: a checkpoint without them is refused before anything
    is built). `name`: the field in a refusal's message."""
    return tensors_of(weight_files(os.path.expanduser(path), name))


def tensors_of(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of weight files, one file in memory at a time."""
    for f in files:
        yield from _load(f).items()


def _load(file: str) -> dict[str, torch.Tensor]:
    """A weight file's tensors."""
    if file.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(file)
    return torch.load(file, map_location="cpu", weights_only=True)


def read_named(files: list[str], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Those of the tensors `names` that the weight files hold (of safetensors files, reading
    no others; a .bin file is read whole, as its load reads it)."""
    from safetensors import safe_open

    found = {}
    for f in files:
        if f.endswith(".safetensors"):
            with safe_open(f, "pt") as held:
                found.update((n, held.get_tensor(n)) for n in names if n in held.keys())
        else:
            state = _load(f)
            found.update((n, state[n]) for n in names if n in state)
    return found


def untie_a_distinct_head(hf_config, files: list[str]) -> None:
    """Untie a checkpoint's config (as transformers' from_pretrained leaves the pair untied)
    where it says tie_word_embeddings but the checkpoint holds an lm_head of other values than
    its embedding: the config is wrong about the checkpoint, whose head is its own. (Two equal
    tensors are a tied pair as .bin checkpoints and some sharders store it: tied.)"""
    if not getattr(hf_config, "tie_word_embeddings", False):
        return
    head = read_named(files, (HEAD,)).get(HEAD)  # mostly absent: the embedding goes unread
    if head is None:
        return
    embedding = read_named(files, (EMBEDDING,)).get(EMBEDDING)
    if embedding is not None and not torch.equal(head, embedding):
        hf_config.tie_word_embeddings = False


# The files a tokenizer is saved as (fast, its config, SentencePiece's, BPE's vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model: str) -> bool:
    """Whether checkpoint `model` holds a tokenizer: one saved with the model alone (a
    trainer's save_pretrained) serves token-id prompts, as an in-memory model without one."""
    return any(locate(model, f) is not None for f in TOKENIZER_FILES)


def locate(model: str, file: str) -> str | None:
    """The local path of `file` of checkpoint `model`, None where it has none: in its folder,
    or, for a hub id, in the hub cache (downloaded there first unless offline), as
    transformers' from_pretrained finds it."""
    if os.path.isdir(model):
        path = os.path.join(model, file)
        return path if os.path.isfile(path) else None
    from transformers.utils import cached_file

    return cached_file(model, file, _raise_exceptions_for_missing_entries=False)


def weight_files(model: str, name: str) -> list[str]:
    """The weight files of checkpoint `model` (WEIGHT_FILES; a folder or a hub id), each
    once."""
    for file in WEIGHT_FILES:
        found = locate(model, file)
        if found is None:
            continue
        if not file.endswith(".index.json"):
            return [found]
        with open(found) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [locate(model, shard) for shard in shards]
        if None in files:
            raise ValueError(f"{name}: {file} names the shard "
                             f"{shards[files.index(None)]!r}, which {model!r} lacks")
        return files
    raise ValueError(f"{name}: no {' or '.join(WEIGHT_FILES)} in {model!r} (the weight files "
                     "transformers reads)")
