"""Where metrics go: the returned history, a JSONL file, and a W&B run (offline by default).

Only the main process writes; every rank's numbers were averaged into it before `log`."""

from __future__ import annotations

import contextlib
import json
import math
import os

from tqdm.auto import tqdm

from .config import WANDB_MODES, RecipeConfig, to_dict


class Tracker:
    def __init__(self, cfg: RecipeConfig, is_main: bool) -> None:
        self.cfg, self.is_main = cfg, is_main
        self.history: list[dict] = []
        self.summary: dict = {}
        self.run = None
        self.jsonl_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        self._jsonl = None
        # An exported but empty $WANDB_MODE reads as unset; any other value is checked here,
        # before a file is created, as the config's own wandb_mode is.
        self.wandb_mode = cfg.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
        if cfg.wandb and self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"WANDB_MODE must be one of {WANDB_MODES} (or unset: offline), got "
                             f"{self.wandb_mode!r}; --wandb_mode wins over it")
        if not is_main:
            return
        os.makedirs(cfg.output_dir, exist_ok=True)
        self._jsonl = open(self.jsonl_path, "w")
        if cfg.wandb and self.wandb_mode != "disabled":
            import wandb

            try:
                with _empty_wandb_mode_unset():
                    self.run = wandb.init(project=cfg.wandb_project, name=cfg.run_name,
                                          mode=self.wandb_mode, dir=cfg.output_dir,
                                          config=to_dict(cfg), reinit="finish_previous")
            except BaseException:
                self.finish()  # the caller gets no tracker to finish: close the file here
                raise

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.history.append(row)
        if not self.is_main:
            return
        self._jsonl.write(json.dumps(_outgoing(row)) + "\n")
        self._jsonl.flush()
        if self.run is not None:
            self.run.log(_outgoing({k: v for k, v in row.items() if k != "step"}), step=step)

    def set_summary(self, **values) -> None:
        self.summary.update({k: _plain(v) for k, v in values.items()})
        if self.run is not None:
            self.run.summary.update(_outgoing(self.summary))

    def print(self, text: str) -> None:
        if self.is_main and self.cfg.progress:
            tqdm.write(text)

    def finish(self) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(_outgoing({"summary": self.summary})) + "\n")
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


@contextlib.contextmanager
def _empty_wandb_mode_unset():
    """An exported but empty $WANDB_MODE unset for the length of wandb.init only: wandb's
    first init reads the environment and refuses "" whatever mode it is given (its settings
    stay as that init read them), and the caller's environment is the caller's."""
    if os.environ.get("WANDB_MODE") != "":
        yield
        return
    del os.environ["WANDB_MODE"]
    try:
        yield
    finally:
        os.environ["WANDB_MODE"] = ""


def _plain(v):
    """Tensors and numpy scalars to Python numbers, infinities and NaN included: the history
    stays numbers (the reward curve computes with them)."""
    return v.item() if hasattr(v, "item") else v


def _outgoing(v):
    """What leaves the process (the JSONL file, W&B): an infinity as the text "inf" / "-inf",
    JSON having no such number (Python's json writes NaN as NaN and reads it back)."""
    if isinstance(v, dict):
        return {k: _outgoing(x) for k, x in v.items()}
    return str(v) if isinstance(v, float) and math.isinf(v) else v
