"""Shared benchmark set-up: the GRPO-shaped workload and the random-weight models."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

# ~25M parameters: the CPU benchmark model of the engine-core issue.
QWEN2_25M = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
# Qwen2.5-0.5B's shapes, for GPU runs.
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 tie_word_embeddings=True)


def add_model_args(ap) -> None:
    """--device, --dtype, --model-shape: the random-weight model a benchmark runs."""
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model-shape", choices=["25m", "0.5b"], default="25m")


def model_from_args(args) -> tuple[dict, torch.nn.Module]:
    """(shape, model) chosen by add_model_args' options."""
    shape = QWEN2_25M if args.model_shape == "25m" else QWEN2_05B
    return shape, random_qwen2(shape, getattr(torch, args.dtype), args.device)


def random_qwen2(shape: dict, dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    config = Qwen2Config(**shape, max_position_embeddings=4096, eos_token_id=None,
                         bos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


def grpo_prompts(num_prompts: int, prompt_len: int, prefix_len: int, vocab: int, seed: int = 0):
    """Prompts of equal length sharing a system prefix (equal lengths keep HF unpadded)."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [system + [rng.randrange(vocab) for _ in range(prompt_len - prefix_len)]
            for _ in range(num_prompts)]
