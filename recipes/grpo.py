"""GRPO / PPO training with the rollout engine in the trainer's process.

    accelerate launch [--num_processes N] recipes/grpo.py --config CONFIG.yaml [--key value]
    accelerate launch recipes/grpo.py --config recipes/configs/gsm8k_qwen.yaml --trainer trl
    python -m rollout_recipes.grpo --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k ...
    CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu --num_processes 2 recipes/grpo.py ...

(The last: 2 CPU processes over gloo. accelerate's own `--cpu` flag starts a single process
unless mpirun is set up.)

Every process builds its own engine on its own device and rolls out its own shard of prompts;
accelerate (DDP) averages the gradients. With `--tensor_parallel_size k`, k consecutive
processes share one engine (each holding 1/k of the model) and one shard of prompts. `--trainer custom` (default) runs the loop in
recipes/algo/custom_loop.py (`--algo grpo|ppo`); `--trainer trl` runs TRL's GRPOTrainer through
trainer_hooks.trl, `--trainer trl_async` TRL's AsyncGRPOTrainer through trainer_hooks.trl_async.
With no model and no dataset, the built-in task and tiny model are used.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # `accelerate launch recipes/grpo.py` runs this file as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout_recipes.run.config import RecipeConfig  # noqa: E402
from rollout_recipes.run.config_file import load_config, parse_overrides  # noqa: E402


def config_from_args(argv: list[str] | None = None) -> RecipeConfig:
    # allow_abbrev=False: argparse would read `--con X` (a typo of any key starting so) as
    # `--config X`; the other keys are RecipeConfig's, each spelled out.
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        epilog="Any other --key value overrides that key of the config "
               "(see recipes/run/config.py for every key).")
    parser.add_argument("--config", action="append", help="YAML file of RecipeConfig keys")
    args, rest = parser.parse_known_args(argv)
    if args.config and len(args.config) > 1:  # argparse would keep the last without a word
        raise ValueError(f"config: given twice or more ({', '.join(args.config)}); give one "
                         f"file and override its keys with --key value")
    return load_config(args.config[0] if args.config else None, parse_overrides(rest))


def main(argv: list[str] | None = None) -> dict:
    """Parse, train, and return the run's record: history, summary, output paths."""
    return run(config_from_args(argv))


def run(cfg: RecipeConfig) -> dict:
    from rollout_recipes.run.session import train

    return train(cfg)


if __name__ == "__main__":
    main()
