"""Field checks shared by every public input (EngineConfig, SamplingParams, SpeculativeConfig,
requests): a bad value raises ValueError naming the field and its limit."""

from __future__ import annotations

import math
import numbers
import reprlib

# Seeds are hashed as two 32-bit halves (sample/noise.py sample_seed): larger ones would alias.
SEED_LIMIT = 1 << 64
# top_k, token ids and positions go to the sampler and kernels as int32.
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


def as_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """`value` as a plain int in [low, high]: any integer type is accepted (numpy's, 0-d arrays
    and tensors), bool and float are not."""
    value = scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {show(value)}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {_bounds(low, high)}, got {show(value)}")
    return value


def as_float(name: str, value) -> float:
    """`value` as a finite plain float: ints, floats, numpy scalars and 0-d arrays/tensors."""
    value = scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {show(value)}")
    try:
        result = float(value)
    except OverflowError:  # an int beyond float's range
        result = math.inf
    if not math.isfinite(result):
        raise ValueError(f"{name} must be a finite float, got {show(value)}")
    return result


def as_bool(name: str, value) -> bool:
    value = scalar(value)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {show(value)}")
    return value


def as_choice(name: str, value, choices: tuple[str, ...]) -> str:
    # The type check first: `in` would compare an array elementwise and raise its own error.
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {show(value)}")
    return value


def show(value) -> str:
    """A short repr for an error message: str() refuses ints over 4300 digits."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an int of {value.bit_length()} bits"
    return reprlib.repr(value)


def scalar(value):
    """numpy scalars and 0-d arrays/tensors as the Python scalar they hold. Anything with more
    dimensions is left for the caller to refuse (operator.index would take a 1-element tensor)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def _bounds(low: int | None, high: int | None) -> str:
    if high is None:
        return f">= {low}"
    if low is None:
        return f"<= {_spell(high)}"
    return f"in [{_spell(low)}, {_spell(high)}]"


def _spell(limit: int) -> str:
    """A limit at a power of two as 2**k (2**31 - 1, -2**31), which says which width it is."""
    sign, size = ("-" if limit < 0 else ""), abs(limit)
    if size >= 1 << 16 and size & (size - 1) == 0:
        return f"{sign}2**{size.bit_length() - 1}"
    if size >= 1 << 16 and size & (size + 1) == 0:
        return f"{sign}2**{size.bit_length()} - 1"
    return str(limit)
