"""Compile Triton kernels for a GPU on a machine without one: the launches a kernel wrapper
makes are recorded (nothing runs; the tensors may be on the CPU), then each distinct one is
compiled for the target, through Triton's whole pipeline down to ptxas's cubin. What only a compiled kernel
meets (tl.dot's shape rules, a branch the interpreter never takes, shared memory) then fails
here rather than in a GPU session's few minutes. The kernels' results are not checked: their
tests do that, interpreted here and compiled on a GPU.

Run in a process where TRITON_INTERPRET is unset (it decides, when a kernel is decorated,
whether it is compiled at all): `python tests/support/gpu_compile.py` prints one line per
distinct launch and exits non-zero if any failed to compile, asked for more shared memory or
threads than a Hopper SM has, or if a kernel of rollout_kernels.triton had no launch
compiled; tests/kernels/test_compile_for_gpu.py runs it.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import time

import torch

# Hopper (H100/H200), the GPU machines this project is lent.
ARCH = 90

# What a Hopper SM gives one block: shared memory (227 KB) and threads. Triton checks these
# only when a GPU loads the kernel.
MAX_SHARED = 232448
MAX_THREADS = 1024


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


def bind(kernel, args, kwargs, arch: int = ARCH):
    """(key, source, options) of the launch as the JIT's own binder specialises it on CUDA:
    its types, constexprs, the alignment and value-1 attributes it derives from the arguments
    (pointers 16-aligned, ints divisible by 16 or equal to 1 unless `do_not_specialize`), its
    options; an option it does not know is a KeyError, as at a launch."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    kwargs = dict(kwargs, debug=knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode,
                  fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    key = (kernel.__name__, repr(specialization), repr(sorted(options.__dict__.items())))
    return key, ASTSource(kernel, signature, constexprs, attrs), options


def compile_launch(source, options, arch: int = ARCH):
    """The bound launch compiled for sm_`arch`, checked against what the SM can give it."""
    import triton
    from triton.backends.compiler import GPUTarget

    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options=options.__dict__)
    if compiled.metadata.shared > MAX_SHARED:
        raise ValueError(f"{compiled.metadata.shared} B of shared memory, the SM has "
                         f"{MAX_SHARED}")
    if compiled.metadata.num_warps * 32 > MAX_THREADS:
        raise ValueError(f"{compiled.metadata.num_warps} warps, a block holds at most "
                         f"{MAX_THREADS // 32}")
    return compiled


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
    step's and a prefill's row counts, as they would on CUDA; and the default mode's MoE."""
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
            w_gate_up = torch.zeros(8, 96, 64, dtype=dtype)
            w_down = torch.zeros(8, 64, 48, dtype=dtype)
            ids = torch.arange(16).remainder(8).view(8, 2)
            fused_moe.fused_moe(torch.zeros(8, 64, dtype=dtype), w_gate_up, w_down,
                                torch.ones(8, 2), ids, invariant=True)
            # the default mode: blocks of 64 tokens past 32 pairs an expert, GELU, an
            # adapter on the experts (its delta through the pair matmul)
            adapter = ((torch.zeros(8, 4, 64), torch.zeros(8, 96, 4), 0.5),
                       (torch.zeros(8, 4, 48), torch.zeros(8, 64, 4), 0.5))
            ids = torch.arange(600).remainder(8).view(300, 2)
            fused_moe.fused_moe(torch.zeros(300, 64, dtype=dtype), w_gate_up, w_down,
                                torch.ones(300, 2), ids, "gelu_pytorch_tanh", adapter)
            wide = torch.zeros(2, 4096, dtype=dtype)  # 8 warps a row
            row_invariant.rms_norm(wide, torch.zeros(4096, dtype=dtype), 1e-6, False)
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


def kernels() -> set[str]:
    """The names of every Triton kernel in rollout_kernels.triton (its `_..._kernel`s)."""
    import pkgutil

    from triton.runtime.jit import JITFunction

    import rollout_kernels.triton as package

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names |= {name for name, value in vars(module).items()
                  if isinstance(value, JITFunction) and name.endswith("_kernel")}
    return names


def main() -> int:
    from triton import knobs

    if knobs.runtime.interpret:
        return "run with TRITON_INTERPRET unset: the interpreter compiles nothing"
    failed, seen, compiled = 0, set(), set()
    recorded = launches() + engine_launches()
    for kernel, args, kwargs in recorded:
        what = f"{kernel.__name__} {', '.join(f'{k}={v}' for k, v in kwargs.items())}"
        try:
            key, source, options = bind(kernel, args, kwargs)
            if key in seen:  # the same compilation (types, constexprs, attributes, options)
                continue
            seen.add(key)
            start = time.perf_counter()
            binary = compile_launch(source, options)
            compiled.add(kernel.__name__)
            print(f"ok {what}: shared {binary.metadata.shared} B, "
                  f"{time.perf_counter() - start:.1f} s")
        except Exception as error:  # every launch reported, then the exit code
            failed += 1
            print(f"FAILED {what}: {type(error).__name__}: {error}")
    for name in sorted(kernels() - compiled):
        failed += 1
        print(f"FAILED {name}: no launch of it compiled (add one to gpu_compile.py)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
