"""Training recipes on the rollout engine: `recipes/grpo.py` (accelerate-launchable, custom
GRPO/PPO loop or TRL's GRPOTrainer) and `recipes/demo.py` (the built-in end-to-end demo)."""
