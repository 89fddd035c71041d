"""GRPO on the real SmolLM2-135M-Instruct on the CPU (recipes/configs/smollm2_arith.yaml): small
sums, rewarded when the reply ends on the right number within the token budget.

The sums are generated here, seeded, into `<output_dir>/sums.jsonl`, which the config's dataset
path (the recipes' local-file loader, recipes/tasks/gsm8k.py) then reads: the chat template and
the held-out split come from there like for any dataset file.

    python -m rollout_recipes.smollm2_arith [--key value ...]
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "smollm2_arith.yaml")
ROWS = 4000


def write_sums(path: str, rows: int, seed: int) -> str:
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for _ in range(rows):
            a, b = rng.randint(1, 19), rng.randint(1, 9)
            f.write(json.dumps({"a": a, "b": b, "answer": str(a + b)}) + "\n")
    return path


def main(argv: list[str] | None = None) -> dict:
    os.environ.setdefault("WANDB_SILENT", "true")
    from rollout_recipes.demo import report
    from rollout_recipes.run.config_file import command_line_overrides, load_config
    from rollout_recipes.run.session import train

    cfg = load_config(CONFIG, command_line_overrides(__doc__, argv))
    if cfg.dataset is None:
        data = write_sums(os.path.join(cfg.output_dir, "sums.jsonl"), ROWS, cfg.split_seed)
        cfg = dataclasses.replace(cfg, dataset=data)  # re-validated: the file exists now
    result = train(cfg)
    print(report(result))
    return result


if __name__ == "__main__":
    main()
