"""Shared benchmark set-up: the GRPO-shaped workload and the random-weight models."""

from __future__ import annotations

import gc
import random
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

# ~25M parameters: the CPU benchmark model of the engine-core issue.
QWEN2_25M = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
# Qwen2.5-0.5B's shapes, for GPU runs.
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 tie_word_embeddings=True)
# SmolLM2-135M-Instruct's shapes (Llama, GQA 9/3). The real checkpoint is the CPU benchmarks'
# model; random weights of its shapes stand in where it cannot go (the GPU machine takes 64 MiB
# of files, the smallest shipped checkpoint is 93 MB) and where weights do not change the cost.
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)
# The sizes of the recipes' built-in model (recipes/run/tiny.py: hidden 128, 2 layers, 4/2
# heads, MLP 4x; built here Qwen2-style like the 25M model): steps so short that the host's
# work, the garbage collector's included, is most of them.
TINY = dict(vocab_size=32, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
# A small Qwen3-MoE (the 25M model's attention and vocabulary, Qwen3-30B-A3B's top-8 routing
# over 32 experts of 256): what the MoE paths cost where experts, not attention, dominate.
QWEN3_MOE_SMALL = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                       num_experts=32, num_experts_per_tok=8, moe_intermediate_size=256,
                       intermediate_size=1408, norm_topk_prob=True, tie_word_embeddings=True)
SHAPES = {"25m": QWEN2_25M, "0.5b": QWEN2_05B, "smollm2": SMOLLM2_135M, "tiny": TINY}


def add_model_args(ap, shape_default: str | None = "25m") -> None:
    """--device, --dtype, --model-shape: the random-weight model a benchmark runs (None: the
    benchmark's own model unless a shape is asked for)."""
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default=shape_default,
                    help="smollm2: a Llama of SmolLM2-135M's shapes, random weights")


def model_from_args(args) -> tuple[dict, torch.nn.Module]:
    """(shape, model) chosen by add_model_args' options."""
    shape = SHAPES[args.model_shape]
    build = random_llama if shape is SMOLLM2_135M else random_qwen2
    return shape, build(shape, getattr(torch, args.dtype), args.device)


def random_qwen2(shape: dict, dtype=torch.float32, device="cpu", seed=0):
    return _random(Qwen2Config, shape, dtype, device, seed)


def random_qwen3_moe(shape: dict, dtype=torch.float32, device="cpu", seed=0):
    return _random(Qwen3MoeConfig, shape, dtype, device, seed)


def random_llama(shape: dict, dtype=torch.float32, device="cpu", seed=0):
    return _random(LlamaConfig, shape, dtype, device, seed)


def _random(config_class, shape: dict, dtype, device, seed: int):
    torch.manual_seed(seed)
    config = config_class(**shape, max_position_embeddings=4096, eos_token_id=None,
                          bos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


def grpo_prompts(num_prompts: int, prompt_len: int, prefix_len: int, vocab: int, seed: int = 0):
    """Prompts of equal length sharing a system prefix (equal lengths keep HF unpadded)."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [system + [rng.randrange(vocab) for _ in range(prompt_len - prefix_len)]
            for _ in range(num_prompts)]


def cpu_name() -> str:
    """The CPU's model name and its widest vector ISA, for the first line of a report."""
    model, isa = "unknown CPU", "no AVX2"
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = next(line.split(":", 1)[1].strip() for line in info.splitlines()
                     if line.startswith("model name"))
        isa = "AVX-512" if "avx512f" in info else "AVX2" if "avx2" in info else isa
    except (OSError, StopIteration):
        pass
    return f"{model}, {isa}"


# Chat prompts of the real-model benchmarks (bench/score.py, bench/lora.py).
CHAT_QUESTIONS = ["What is 13 + 7?", "Name three primary colours.",
                  "Write a Python function that reverses a string.",
                  "What is the capital of France?", "Explain recursion in one sentence.",
                  "Give me a haiku about rain.", "Is 17 a prime number? Answer yes or no.",
                  "List the planets of the solar system."]


class CollectorPauses:
    """The garbage collector's pauses while the block runs, by generation. A full collection
    walks every tracked object of the process (a trainer's imports alone are ~400K), so how
    often the engine's allocations bring one on is part of its step time."""

    def __enter__(self) -> CollectorPauses:
        self.count, self.seconds, self._start = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._on_collect)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_collect)

    def _on_collect(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def summary(self, seconds: float) -> str:
        """Counts and time per generation, and their share of `seconds`."""
        return (f"garbage collections (generations 0/1/2) {'/'.join(map(str, self.count))}, "
                f"{sum(self.seconds):.3f} s = {sum(self.seconds) / seconds:.1%} of the run "
                f"(full ones {self.seconds[2]:.3f} s)")
