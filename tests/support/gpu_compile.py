"""Compile Triton kernels for a GPU on a machine without one: the launches a kernel wrapper
makes are recorded (nothing runs; the tensors may be on the CPU), then each is compiled for the
target, through Triton's whole pipeline down to ptxas's cubin. What only a compiled kernel
meets (tl.dot's shape rules, a branch the interpreter never takes, shared memory) then fails
here rather than in a GPU session's few minutes. The kernels' results are not checked: their
tests do that, interpreted here and compiled on a GPU.

Run in a process where TRITON_INTERPRET is unset (it decides, when a kernel is decorated,
whether it is compiled at all): `python tests/support/gpu_compile.py` prints one line per
launch and exits non-zero if any failed; tests/kernels/test_compile_for_gpu.py runs it.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

# Hopper (H100/H200), the GPU machines this project is lent.
ARCH = 90

_POINTERS = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
             torch.int32: "*i32", torch.int64: "*i64", torch.bool: "*i1", torch.uint8: "*u8"}


@contextlib.contextmanager
def recorded_launches():
    """Within it, `kernel[grid](...)` records (kernel, args, kwargs) instead of launching."""
    from triton.runtime.jit import JITFunction

    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    run = JITFunction.run
    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return _POINTERS[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def compile_launch(kernel, args, kwargs, arch: int = ARCH):
    """The launch compiled for sm_`arch` (no specialisation on values or alignment)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bound = dict(zip((p.name for p in kernel.params), args))
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound.update(kwargs)
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        else:
            signature[param.name] = _type(value)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


@contextlib.contextmanager
def as_on_gpu():
    """The wrappers choose tiles and dot precision by whether their tensors are on CUDA: on
    the CPU tensors of a recording they would choose the interpreter's."""
    from rollout_kernels.triton import fused_moe, row_invariant

    saved = {(m, name): getattr(m, name) for m, name in (
        (row_invariant, "_linear_config"), (row_invariant, "dot_precision"),
        (fused_moe, "_config"), (fused_moe, "dot_precision"))}
    row_invariant._linear_config = lambda on_gpu: saved[row_invariant, "_linear_config"](True)
    precision = saved[row_invariant, "dot_precision"]
    row_invariant.dot_precision = fused_moe.dot_precision = lambda dtype, on_gpu: precision(
        dtype, True)
    config = saved[fused_moe, "_config"]
    fused_moe._config = lambda pairs, experts, on_gpu, invariant: config(pairs, experts, True,
                                                                         invariant)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def launches():
    """What the batch-invariant mode's wrappers launch (kernels/triton/row_invariant.py, the
    invariant fused MoE, the LoRA shrink and expand), in fp32, bf16 and fp16, at a decode
    step's and a prefill's row counts, as they would on CUDA."""
    from rollout_kernels.triton import fused_moe, lora, row_invariant

    with recorded_launches() as recorded, as_on_gpu():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for rows in (1, 300):
                x = torch.zeros(rows, 576, dtype=dtype)
                row_invariant.linear(x, torch.zeros(1536, 576, dtype=dtype),
                                     torch.zeros(1536, dtype=dtype))
                row_invariant.rms_norm(x, torch.zeros(576, dtype=dtype), 1e-6, False)
                row_invariant.rms_norm(x, torch.zeros(576, dtype=dtype), 1e-6, True)
            row_invariant.row_sum(torch.zeros(3, 49152, dtype=dtype))
            ids = torch.arange(16).remainder(8).view(8, 2)
            fused_moe.fused_moe(torch.zeros(8, 64, dtype=dtype), torch.zeros(8, 96, 64, dtype=dtype),
                                torch.zeros(8, 64, 48, dtype=dtype), torch.ones(8, 2), ids,
                                invariant=True)
        x = torch.zeros(5, 576)
        s = lora.lora_shrink(x, torch.zeros(24, 576))
        blocks = torch.zeros(2, 3, dtype=torch.int32)
        lora.lora_expand_add(s, torch.zeros(1536, 24), torch.zeros(5, 1536), blocks,
                             torch.zeros(2, dtype=torch.int32), torch.zeros(2), 768, 12)
    return recorded


def main() -> int:
    failed = 0
    for kernel, args, kwargs in launches():
        what = f"{kernel.__name__} {', '.join(f'{k}={v}' for k, v in kwargs.items())}"
        try:
            compiled = compile_launch(kernel, args, dict(kwargs))
            print(f"ok {what}: shared {compiled.metadata.shared} B")
        except Exception as error:  # every launch reported, then the exit code
            failed += 1
            print(f"FAILED {what}: {type(error).__name__}: {error}")
    return 1 if failed else 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run with TRITON_INTERPRET unset: the interpreter compiles nothing")
    sys.exit(main())
