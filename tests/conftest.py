import os
import sys

# Tests import the local helpers (tests/models.py) by plain name.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402

# Tiny models: one thread avoids oversubscription on the 2-core CI machine (several times
# faster per step under load than the default).
torch.set_num_threads(1)
