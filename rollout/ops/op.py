"""An operation with one implementation per backend, and the layers built on it.

`Op` names the implementations of a function (the sampler's Gumbel argmax, the acceptance scan,
the attention backend's class): each is a callable and a `supported(device, dtype)` check.
`Dispatched` is the same for an nn.Module: its `forward_torch` is the reference, `forward_cpu`
and `forward_triton` the kernels it has, each with its check in `implementations`. Which one runs
is decided once, when the engine builds the layer (Backend.choose, rollout/ops/backend.py), not
per call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Supported = Callable[[torch.device, torch.dtype], bool]


def always(device: torch.device, dtype: torch.dtype) -> bool:
    return True


def on_cuda(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda"


class Op:
    def __init__(self, name: str, **implementations: tuple[Callable, Supported]) -> None:
        """`implementations`: backend name -> (callable, supported); "torch" is required and
        is the reference the others are tested against."""
        if "torch" not in implementations:
            raise ValueError(f"op {name}: a torch implementation is required")
        self.name = name
        self.functions = {b: fn for b, (fn, _) in implementations.items()}
        self.implementations: Mapping[str, Supported] = {
            b: ok for b, (_, ok) in implementations.items()}


class Dispatched:
    """Mixin of an nn.Module with implementations per backend (see the module docstring)."""

    implementations: Mapping[str, Supported] = {"torch": always}
    _implementation = "torch"  # until the engine's backend chooses (use_backend)
    # The chosen forward as a plain function of the class, looked up when it is chosen, not per
    # call (a bound method kept on the module would be a reference cycle through it).
    _chosen_forward = None

    @property
    def implementation(self) -> str:
        return self._implementation

    @implementation.setter
    def implementation(self, name: str) -> None:
        self._implementation = name
        self._chosen_forward = getattr(type(self), f"forward_{name}")

    def use_backend(self, backend, dtype: torch.dtype) -> None:
        self.implementation = backend.choose(self.implementations, dtype)

    def forward(self, *args, **kwargs):
        forward = self._chosen_forward or type(self).forward_torch
        return forward(self, *args, **kwargs)
