"""The project's one cache directory on disk: $ROLLOUT_CACHE, else ~/.cache/rollout. The C
kernels' builds live under it (cpu/), and so does what the recipes convert once (the SmolLM2
checkpoint, rollout_recipes/run/smollm2.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ROLLOUT_CACHE")
                or os.path.join(os.path.expanduser("~"), ".cache", "rollout"))
