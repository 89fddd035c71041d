"""The tensor-parallel group a model is being built for.

Every family composes the shared layers (models/layers/), and those decide what a rank keeps:
reading the group while the model is constructed spares each family's constructors from
passing it through. Each layer stores the group it was built with; nothing reads this after
construction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .group import SINGLE, TensorParallel

_building = SINGLE


@contextlib.contextmanager
def building_for(tp: TensorParallel) -> Iterator[None]:
    global _building
    before, _building = _building, tp
    try:
        yield
    finally:
        _building = before


def current() -> TensorParallel:
    return _building
