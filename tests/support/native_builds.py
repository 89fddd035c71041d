"""Results of the C kernels under another build of them: the ISA tests run the same code in a
subprocess under this host's build and under other ones (ROLLOUT_NATIVE_MARCH, _CFLAGS, each
in its own ROLLOUT_CACHE) and compare the bits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).parents[2]


def computed(code: str, path: Path, **env):
    """What `code` (dedented; it saves its result with torch.save to sys.argv[1]) computed,
    run from the repository root with `env` added to this process's environment."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(path)], cwd=ROOT,
                          env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(path)
