import os
import sys

# Tests import the local helpers (tests/models.py) by plain name.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402

# Without a GPU the suite runs the Triton kernels (and the engine's triton backend) in Triton's
# interpreter: set before anything imports triton, as any process that wants it must (the
# engine never sets it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny models: one thread avoids oversubscription on the 2-core CI machine (several times
# faster per step under load than the default).
torch.set_num_threads(1)
