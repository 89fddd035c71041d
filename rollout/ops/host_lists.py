"""A step's host lists (lengths, slots, token ids, sampling parameters) as tensors.

`torch.tensor(list)` inspects every element's Python type: ~9.5 us for 128 ints on the
project's CPUs against ~3 us through an `array` of the C type, and a step builds some twenty of
them (docs/benchmarks.md, "Where the time goes"). Values in range convert as torch.tensor
converts them (floats round to nearest); where torch.tensor would refuse or truncate, this
raises: OverflowError for an int out of the dtype's range, TypeError for a float in an int
list (the step's lists hold checked ints: rollout/fields.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import torch

_CODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}  # what a step's lists hold


def host_tensor(values: Iterable, dtype: torch.dtype, device: torch.device | str = "cpu"
                ) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device) for Python numbers, dtype int64,
    int32 or float32."""
    buffer = array(_CODES[dtype], values)
    if not buffer:
        return torch.empty(0, dtype=dtype, device=device)
    # The tensor keeps the array alive and shares its memory; nothing else holds the array.
    return torch.frombuffer(buffer, dtype=dtype).to(device)
