"""The C kernels as torch operators, `torch.ops.rollout.<name>`, so that what watches torch's
dispatcher sees them: torch.compile traces each as one operator (its fake function gives the
output's shape without running it), the profiler lists it by name with its time, and
`torch.library.opcheck` holds its schema to what it reads and writes.

A call through the dispatcher costs a few microseconds more than calling the kernel (a Python
kernel boxed and unboxed; measured in docs/benchmarks.md), and a decode step makes about nine
such calls a layer. So a function decorated here calls its C directly, and goes through its
operator only while something watches: dynamo tracing it, or the autograd profiler (which
torch.profiler drives) on. Both checks cost a fraction of a microsecond.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

NAMESPACE = "rollout"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def watched() -> bool:
    """Whether dynamo is tracing this call or the profiler is recording."""
    return torch.compiler.is_compiling() or torch.autograd._profiler_enabled()


def operator(schema: str, fake: Callable) -> Callable[[Callable], Callable]:
    """Decorator: define `rollout::<schema>` with the decorated function as its CPU kernel and
    `fake` as its fake (shape) function. The function returned calls the kernel itself unless
    `watched()`, else the operator (its `op`); arguments positional, as the schema orders them."""
    def define(kernel: Callable) -> Callable:
        name = schema.split("(", 1)[0]
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, kernel, "CPU")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
        op = getattr(getattr(torch.ops, NAMESPACE), name).default

        @functools.wraps(kernel)
        def call(*args):
            return op(*args) if watched() else kernel(*args)

        call.op = op
        return call

    return define


def returns_nothing(*args) -> None:
    """The fake function of an operator that only writes into its arguments."""
    return None
