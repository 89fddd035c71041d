"""The engine: requests in, one transactional step at a time, outputs out (engine.py); the
running requests (requests.py), scheduling policy (scheduler.py), the commit of a step's tokens
(commit.py), stop conditions (stop.py), the one-caller guard (guard.py), counters (stats.py)."""

from .engine import Engine

__all__ = ["Engine"]
