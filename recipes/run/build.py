"""Model, tokenizer and engine for a recipe, from its config."""

from __future__ import annotations

import torch

from rollout import Engine

from ..algo.routing_replay import moe_routers
from .config import RecipeConfig
from .options import engine_config, lora_config
from .smollm2 import resolve
from .tiny import char_tokenizer, tiny_llama


def load_tokenizer(cfg: RecipeConfig, alphabet: str | None):
    if cfg.model is None:
        return char_tokenizer(alphabet)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve(cfg.model))
    if tok.pad_token is None:  # right-padding of training batches needs some pad id
        tok.pad_token = tok.eos_token
    return tok


def load_model(cfg: RecipeConfig, tokenizer, device: torch.device):
    if cfg.model is None:
        model = tiny_llama(tokenizer, cfg.seed, **cfg.tiny_model).to(getattr(torch,
                                                                           cfg.model_dtype))
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(resolve(cfg.model),
                                                     dtype=getattr(torch, cfg.model_dtype))
    if cfg.routing_replay and not moe_routers(model):
        # Known once loaded (RecipeConfig refuses the built-in dense model before): a dense
        # model has no routes to replay, and the flag would change nothing.
        raise ValueError(f"routing_replay: {cfg.model!r} has no MoE router to replay (a dense "
                         f"model); set --routing_replay false")
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    lora = lora_config(cfg)
    if lora is not None:  # only the adapter trains; the engine serves it (EngineConfig.lora)
        import peft

        model = peft.get_peft_model(model, lora)
    return model.to(device)


def frozen_copy(model):
    """The reference policy for the KL term: the starting weights, never trained."""
    import copy

    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def build_engine(cfg: RecipeConfig, model, tokenizer, engine_index: int = 0) -> Engine:
    """The engine copies the weights it starts from; ColocatedRollout keeps them in sync. With
    tensor_parallel_size > 1 a collective: every rank builds its engine at the same point."""
    return Engine(model, engine_config(cfg, engine_index), tokenizer=tokenizer)
