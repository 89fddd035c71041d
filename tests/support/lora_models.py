"""PEFT LoRA models on the tiny families, with adapters that matter (random B)."""

from __future__ import annotations

import torch
from models import MOE, tiny_model

# Phi-3 stores q/k/v and gate/up fused: PEFT targets the fused linears. On the MoE families
# PEFT turns the experts' module names into `target_parameters` (the stacked gate_up_proj and
# down_proj, a ParamWrapper each, nested).
DENSE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
           "mixtral": [*ATTENTION, "w1", "w2", "w3"]}
assert set(MOE) == {"qwen3_moe", "mixtral"}  # qwen3_moe: DENSE's names


def lora_config(family: str = "qwen2", **lora):
    import peft

    options = dict(r=4, lora_alpha=8, target_modules=TARGETS.get(family, DENSE), lora_dropout=0.0)
    options.update(lora)
    return peft.LoraConfig(**options)


def randomise_b(model, seed: int, std: float = 0.3) -> None:
    """PEFT starts B at zero (a no-op adapter): random B makes every adapter count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def peft_model(family: str = "qwen2", seed: int = 0, b_std: float = 0.3, **lora):
    import peft

    model = peft.get_peft_model(tiny_model(family, seed=seed), lora_config(family, **lora))
    randomise_b(model, seed + 1, b_std)
    return model.eval()


def adapter_bytes(model) -> int:
    """Bytes of the active adapter's A and B matrices."""
    active = set(model.active_adapters)
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if ("lora_A." in name or "lora_B." in name)
               and name.split(".lora_")[1].split(".")[1] in active)
