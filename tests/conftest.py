import os
import sys

# Tests import the local helpers (tests/models.py) by plain name.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
