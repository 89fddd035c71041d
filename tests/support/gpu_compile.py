"""Compile Triton kernels for a GPU on a machine without one: the launches a kernel wrapper
makes are recorded (nothing runs; the tensors may be on the CPU), then each distinct one is
compiled for the target, through Triton's whole pipeline down to ptxas's cubin. What only a compiled kernel
meets (tl.dot's shape rules, a branch the interpreter never takes, shared memory) then fails
here rather than in a GPU session's few minutes. The kernels' results are not checked: their
tests do that, interpreted here and compiled on a GPU.

Run in a process where TRITON_INTERPRET is unset (it decides, when a kernel is decorated,
whether it is compiled at all): `python tests/support/gpu_compile.py` prints one line per
launch and exits non-zero if any failed; tests/kernels/test_compile_for_gpu.py runs it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time

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
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion")
               if k in kwargs}
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
    """The wrappers choose tiles, dot precision and libdevice by whether their tensors are on
    CUDA: on the CPU tensors of a recording they would choose the interpreter's."""
    from rollout_kernels.triton import counter_noise, fused_moe, row_invariant

    # the module, not the package's `sample` function of the same name
    sample = importlib.import_module("rollout_kernels.triton.sample")
    saved = {(m, name): getattr(m, name) for m, name in (
        (row_invariant, "_linear_config"), (row_invariant, "dot_precision"),
        (fused_moe, "_config"), (fused_moe, "dot_precision"),
        (counter_noise, "use_libdevice"), (sample, "use_libdevice"))}
    row_invariant._linear_config = lambda on_gpu: saved[row_invariant, "_linear_config"](True)
    precision = saved[row_invariant, "dot_precision"]
    row_invariant.dot_precision = fused_moe.dot_precision = lambda dtype, on_gpu: precision(
        dtype, True)
    config = saved[fused_moe, "_config"]
    fused_moe._config = lambda pairs, experts, on_gpu, invariant: config(pairs, experts, True,
                                                                         invariant)
    counter_noise.use_libdevice = sample.use_libdevice = lambda device: True
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


def engine_launches():
    """What the Triton backend's other wrappers launch as on CUDA: the fused sampler and the
    noise (their libdevice branch, which the interpreter never takes), paged attention
    (decode, prefill, split-KV and merge, sliding window, soft-capping, the invariant mode;
    head sizes 64, 128 and 256), the shared-prefix path, the K/V store, draft acceptance."""
    from rollout_kernels.triton import (accept_drafts, gumbel_noise_triton, paged_attention,
                                        sample, shared_prefix_attention, store_kv)

    with recorded_launches() as recorded, as_on_gpu():
        for dtype in (torch.float32, torch.bfloat16):
            rows = torch.ones(4, dtype=torch.int32)
            sample(torch.zeros(4, 1000, dtype=dtype), rows.float(), rows, rows.float(),
                   rows.float() * 0, rows, rows)
        gumbel_noise_triton(torch.ones(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32),
                            1000)
        for dtype, head_dim in ((torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 256),
                                (torch.float16, 128)):
            q = torch.zeros(8, 6, head_dim, dtype=dtype)
            pool = torch.zeros(64, 2, head_dim, dtype=dtype)
            qo = torch.tensor([0, 4, 8], dtype=torch.int32)
            kv = torch.tensor([0, 32, 64], dtype=torch.int32)
            slots = torch.arange(64, dtype=torch.int32)
            store_kv(q[:, :2], q[:, :2], pool, pool, slots[:8])
            for extra in (dict(), dict(window=8, softcap=30.0), dict(invariant=True),
                          dict(num_kv_splits=4)):
                paged_attention(q, pool, pool, torch.empty_like(q), qo, kv, slots,
                                sm_scale=0.1, max_q_len=4, max_kv_len=32, **extra)
            decode = q[:2]
            paged_attention(decode, pool, pool, torch.empty_like(decode),
                            torch.tensor([0, 1, 2], dtype=torch.int32), kv, slots,
                            sm_scale=0.1, max_q_len=1, max_kv_len=32, num_kv_splits=2)
            group = torch.tensor([0, 4], dtype=torch.int32)  # one group of 4, a 16-slot prefix
            prefix = torch.tensor([0, 16], dtype=torch.int32)
            suffixes = torch.tensor([0, 2, 4, 6, 8], dtype=torch.int32)
            shared_prefix_attention(q[:4], pool, pool, torch.empty_like(q[:4]), group, prefix,
                                    slots[:16], suffixes, slots[16:24], sm_scale=0.1,
                                    max_group_size=4, max_prefix_len=16, max_suffix_len=2,
                                    num_prefix_splits=2)
        indptr = torch.tensor([0, 3, 6], dtype=torch.int32)
        tokens = torch.zeros(6, dtype=torch.int64)
        greedy = torch.zeros(6, dtype=torch.bool)
        accept_drafts(indptr, tokens, tokens, greedy)
        accept_drafts(indptr, tokens, tokens, greedy, torch.ones(6), torch.ones(6),
                      torch.ones(6), tokens)
    return recorded


def main() -> int:
    failed = 0
    seen = set()
    for kernel, args, kwargs in launches() + engine_launches():
        key = (kernel.__name__, tuple(_type(a) if not isinstance(a, (int, float)) or
                                      isinstance(a, bool) else type(a).__name__ for a in args),
               tuple(sorted(kwargs.items())))
        if key in seen:  # the same compilation (constexprs and types alike)
            continue
        seen.add(key)
        what = f"{kernel.__name__} {', '.join(f'{k}={v}' for k, v in kwargs.items())}"
        try:
            start = time.perf_counter()
            compiled = compile_launch(kernel, args, dict(kwargs))
            print(f"ok {what}: shared {compiled.metadata.shared} B, "
                  f"{time.perf_counter() - start:.1f} s")
        except Exception as error:  # every launch reported, then the exit code
            failed += 1
            print(f"FAILED {what}: {type(error).__name__}: {error}")
    return 1 if failed else 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run with TRITON_INTERPRET unset: the interpreter compiles nothing")
    sys.exit(main())
