"""LoRA served unmerged: a PEFT model's adapter beside the base weights, synced alone."""
