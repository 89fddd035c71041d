"""Where metrics go: the returned history, a JSONL file, and a W&B run (offline by default).

Only the main process writes; every rank's numbers were averaged into it before `log`."""

from __future__ import annotations

import json
import math
import os

from tqdm.auto import tqdm

from .config import RecipeConfig, to_dict


class Tracker:
    def __init__(self, cfg: RecipeConfig, is_main: bool) -> None:
        self.cfg, self.is_main = cfg, is_main
        self.history: list[dict] = []
        self.summary: dict = {}
        self.run = None
        self.jsonl_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        self._jsonl = None
        self.wandb_mode = cfg.wandb_mode or os.environ.get("WANDB_MODE", "offline")
        if not is_main:
            return
        os.makedirs(cfg.output_dir, exist_ok=True)
        self._jsonl = open(self.jsonl_path, "w")
        mode = self.wandb_mode
        if cfg.wandb and mode != "disabled":
            import wandb

            self.run = wandb.init(project=cfg.wandb_project, name=cfg.run_name, mode=mode,
                                  dir=cfg.output_dir, config=to_dict(cfg), reinit="finish_previous")

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.history.append(row)
        if not self.is_main:
            return
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def set_summary(self, **values) -> None:
        self.summary.update({k: _plain(v) for k, v in values.items()})
        if self.run is not None:
            self.run.summary.update(self.summary)

    def print(self, text: str) -> None:
        if self.is_main and self.cfg.progress:
            tqdm.write(text)

    def finish(self) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"summary": self.summary}) + "\n")
            self._jsonl.close()
            self._jsonl = None
        if self.run is not None:
            self.run.finish()
            self.run = None

    @property
    def wandb_dir(self) -> str | None:
        """Where the W&B run writes (None: no run)."""
        if not self.cfg.wandb or self.wandb_mode == "disabled":
            return None
        return os.path.join(self.cfg.output_dir, "wandb")


def _plain(v):
    """Tensors and numpy scalars to Python numbers; NaN stays NaN (JSON writes it as NaN)."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and math.isinf(v):
        return str(v)
    return v
