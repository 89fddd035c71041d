"""What every Triton kernel variant the engine launches costs on a GPU that is not here.

Each engine step kind (store, prefill, extend, a chunk beside decodes, decode with and without
split-KV, speculative verify, shared-prefix decode, sliding-window and soft-capped attention,
sampling and its noise, draft acceptance, MoE experts with and without an adapter, an unmerged
LoRA adapter, and the batch-invariant mode's projections, norms and row sums) is driven through
the real launch wrappers in `kernels/` on CPU tensors shaped like a named model. Launches are
compiled for the target GPU with Triton's own compiler, never run, and each distinct variant is
reported against the target's limits; a Triton kernel of `rollout_kernels.triton` that no case
launches is reported too (and fails the run), so a new kernel is compiled here before a GPU
session spends its minutes on it:

  shared   bytes of shared memory per block; over the target's per-block limit the launch would
           fail with OutOfResources, so the report exits 1
  regs     registers per thread; `spill` is local memory per thread (register spills)
  occ      warps resident per SM as a share of the SM's maximum, from registers, shared memory
           and warps (how much latency hiding the tile leaves)

While the wrappers run, reading a device tensor on the host (.item(), .tolist(), bool(t), ...)
raises: the wrappers must stay free of host synchronisation so a decode step can be captured in
a CUDA graph. Needs no GPU; uses Triton's internal launch binder (written against triton 3.9).

    python bench/kernel_resources.py                       # H200, three model shapes, bf16
    python bench/kernel_resources.py --target all --dtypes bfloat16,float32 --tiles
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import subprocess
import sys
import tempfile
from typing import Callable
from unittest import mock

if __name__ == "__main__":
    # Compiled, not interpreted: triton.jit reads this when the kernels are first decorated.
    os.environ["TRITON_INTERPRET"] = "0"

# isort: off
import rollout_kernels.triton  # noqa: E402, F401
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402
# isort: on


@dataclasses.dataclass(frozen=True)
class Target:
    arch: int
    sms: int
    smem_per_block: int  # opt-in maximum of dynamic shared memory per block
    smem_per_sm: int
    max_warps_per_sm: int
    regs_per_sm: int = 65536
    max_blocks_per_sm: int = 32


TARGETS = {
    "h200": Target(arch=90, sms=132, smem_per_block=227 * 1024, smem_per_sm=228 * 1024,
                   max_warps_per_sm=64),
    "a100": Target(arch=80, sms=108, smem_per_block=163 * 1024, smem_per_sm=164 * 1024,
                   max_warps_per_sm=64),
    "l40s": Target(arch=89, sms=142, smem_per_block=99 * 1024, smem_per_sm=100 * 1024,
                   max_warps_per_sm=48),
}

# (query heads, KV heads, head dim, vocab): GQA groups of 4, 7 and 2, head dims 128 and 64.
MODELS = {
    "llama-3-8b": (32, 8, 128, 128256),
    "qwen2-0.5b": (14, 2, 64, 151936),
    "qwen3-0.6b": (16, 8, 128, 151936),
    "gemma-2-2b": (8, 4, 256, 256000),
}


class HostRead(RuntimeError):
    """A launch wrapper read a device tensor on the host (a synchronisation on a GPU)."""


@contextlib.contextmanager
def no_host_reads():
    """Every Python-level way of pulling a tensor's value to the host raises HostRead."""
    def refuse(name):
        def read(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name} read a {tuple(self.shape)} tensor on the host")
        return read

    names = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(torch.Tensor, name, refuse(name)))
        yield


@dataclasses.dataclass
class Variant:
    kernel: str
    cases: list[str]
    constexprs: dict
    num_warps: int
    num_stages: int
    shared: int
    regs: int
    spill: int
    engine: bool  # launched by an engine step, not only by the benchmark's tile sweep

    def resident_warps(self, t: Target) -> int:
        # Registers are allocated per warp in units of 256.
        warp_regs = math.ceil(self.regs * 32 / 256) * 256
        blocks = min(t.max_blocks_per_sm, t.max_warps_per_sm // self.num_warps,
                     (t.regs_per_sm // max(warp_regs, 1)) // self.num_warps)
        if self.shared:
            blocks = min(blocks, t.smem_per_sm // (self.shared + 1024))  # 1 KB reserved/block
        return blocks * self.num_warps


class Recorder:
    """Replaces JITFunction.run: binds a launch exactly as Triton would, compiles it for the
    target and records the variant; the launch itself does nothing."""

    def __init__(self, target: Target):
        self.target = target
        self.gpu = GPUTarget("cuda", target.arch, 32)
        self.backend = make_backend(self.gpu)
        self.variants: dict[str, Variant] = {}
        self.case = ""
        self.engine = True

    def run(self, fn: JITFunction, *args, grid, warmup, **kwargs):
        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(
            self.backend, kwargs, bound, specialization, options)
        key = repr((fn.fn.__qualname__, signature, constexprs, attrs, options))
        if key in self.variants:
            variant = self.variants[key]
            variant.cases.append(self.case)
            variant.engine |= self.engine
            return None
        compiled = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=self.gpu,
                                  options=options.__dict__)
        regs, spill = cubin_usage(compiled.asm["cubin"])
        self.variants[key] = Variant(
            kernel=fn.fn.__name__, cases=[self.case],
            constexprs={fn.arg_names[path[0]]: v for path, v in constexprs.items()},
            num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages,
            shared=compiled.metadata.shared, regs=regs, spill=spill, engine=self.engine)
        return None

    @contextlib.contextmanager
    def launching_as_target(self):
        """Kernel launches are recorded; the wrappers see the target's SM count and CUDA-only
        code paths (libdevice), as they would on that GPU."""
        recorder = self

        def run(fn, *args, **kwargs):
            return recorder.run(fn, *args, **kwargs)

        pa = sys.modules["rollout_kernels.triton.paged_attention"]
        sp = sys.modules["rollout_kernels.triton.shared_prefix"]
        sample = sys.modules["rollout_kernels.triton.sample"]
        noise = sys.modules["rollout_kernels.triton.counter_noise"]
        rows = sys.modules["rollout_kernels.triton.row_invariant"]
        moe = sys.modules["rollout_kernels.triton.fused_moe"]
        # The choices the wrappers make by whether their tensors are on CUDA, as CUDA makes them.
        linear_config, precision, moe_config = rows._linear_config, rows.dot_precision, moe._config
        with mock.patch.object(JITFunction, "run", run), \
                mock.patch.object(pa, "_num_sms", lambda device: self.target.sms), \
                mock.patch.object(sp, "_num_sms", lambda device: self.target.sms), \
                mock.patch.object(sample, "use_libdevice", lambda device: True), \
                mock.patch.object(noise, "use_libdevice", lambda device: True), \
                mock.patch.object(rows, "_linear_config", lambda on_gpu: linear_config(True)), \
                mock.patch.object(rows, "dot_precision", lambda dt, on_gpu: precision(dt, True)), \
                mock.patch.object(moe, "dot_precision", lambda dt, on_gpu: precision(dt, True)), \
                mock.patch.object(moe, "_config", lambda pairs, experts, on_gpu, invariant:
                                  moe_config(pairs, experts, True, invariant)), \
                no_host_reads():
            yield


def cubin_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local memory bytes per thread) from cuobjdump, shipped in
    Triton's wheel."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(item.split(":", 1) for line in text.splitlines() if "REG:" in line
                  for item in line.split())
    return int(fields["REG"]), int(fields["LOCAL"])


# --- the engine's launches -------------------------------------------------------------------

def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out


def engine_cases(model: str, dtype: torch.dtype) -> list[tuple[str, Callable[[], object]]]:
    """(case name, launch) for each step kind of `model`. Nothing runs, so contexts are
    described by their lengths alone: the pool and slot tensors stay small."""
    from rollout_kernels.triton import (
        accept_drafts,
        gumbel_noise_triton,
        lora_expand_add,
        lora_shrink,
        paged_attention,
        row_invariant,
        sample,
        shared_prefix_attention,
        store_kv,
    )
    from rollout_kernels.triton.fused_moe import fused_moe

    hq, hkv, d, vocab = MODELS[model]
    hidden = hq * d
    pool_k = torch.empty(4096, hkv, d, dtype=dtype)
    pool_v = torch.empty_like(pool_k)
    slots = torch.zeros(4096, dtype=torch.int32)
    scale = d ** -0.5

    def attention(q_lens: list[int], kv_lens: list[int], window=None, softcap=None):
        q = torch.empty(sum(q_lens), hq, d, dtype=dtype)
        return lambda: paged_attention(q, pool_k, pool_v, torch.empty_like(q), _indptr(q_lens),
                                       _indptr(kv_lens), slots, sm_scale=scale,
                                       max_q_len=max(q_lens), max_kv_len=max(kv_lens),
                                       window=window, softcap=softcap)

    def store(tokens: int):
        qkv = torch.empty(tokens, (hq + 2 * hkv) * d, dtype=dtype)  # fused QKV, as the model
        k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
        return lambda: store_kv(k, v, pool_k, pool_v, slots[:tokens].long())

    def shared_prefix(groups: int, n: int, prefix: int, suffix: int, softcap=None):
        q = torch.empty(groups * n, hq, d, dtype=dtype)
        return lambda: shared_prefix_attention(
            q, pool_k, pool_v, torch.empty_like(q), _indptr([n] * groups),
            _indptr([prefix] * groups), slots, _indptr([suffix] * (groups * n)), slots,
            sm_scale=scale, max_group_size=n, max_prefix_len=prefix, max_suffix_len=suffix,
            softcap=softcap)

    def sampler(batch: int):
        ints = torch.zeros(batch, dtype=torch.int32)  # top_k, seed, position
        return lambda: sample(torch.empty(batch, vocab), torch.ones(batch), ints,
                              torch.ones(batch), torch.zeros(batch), ints, ints)

    def accept(rows: int, rejection: bool):
        row_indptr = _indptr([5] * (rows // 5))
        tokens = torch.zeros(rows, dtype=torch.int64)
        probs = torch.zeros(rows) if rejection else None
        return lambda: accept_drafts(row_indptr, tokens, tokens, torch.zeros(rows, dtype=bool),
                                     probs, probs, probs, tokens if rejection else None)

    def noise(batch: int):
        ints = torch.zeros(batch, dtype=torch.int32)  # seed, position
        return lambda: gumbel_noise_triton(ints, ints, vocab)

    def projection(rows: int):  # a gate-up's shape, the batch-invariant mode's matmul
        x = torch.empty(rows, hidden, dtype=dtype)
        w = torch.empty(4 * hidden, hidden, dtype=dtype)
        return lambda: row_invariant.linear(x, w, torch.empty(4 * hidden, dtype=dtype))

    def norm(rows: int, offset: bool):
        x = torch.empty(rows, hidden, dtype=dtype)
        return lambda: row_invariant.rms_norm(x, torch.empty(hidden, dtype=dtype), 1e-6, offset)

    def row_sums(batch: int):
        return lambda: row_invariant.row_sum(torch.empty(batch, vocab))

    def lora(tokens: int, rank: int, precision: str):  # q, k, v blocks of a fused QKV
        x = torch.empty(tokens, hidden, dtype=dtype)
        a = torch.empty(3 * rank, hidden)
        b = torch.empty((hq + 2 * hkv) * d, 3 * rank)
        y = torch.empty(tokens, (hq + 2 * hkv) * d, dtype=dtype)
        blocks = torch.zeros(3, 3, dtype=torch.int32)
        ranks = torch.full((3,), rank, dtype=torch.int32)

        def launch():
            s = lora_shrink(x, a, precision)
            lora_expand_add(s, b, y, blocks, ranks, torch.ones(3), hq * d, rank, precision)
        return launch

    def experts(tokens: int, invariant: bool, rank: int | None = None, act: str = "silu"):
        # 8 experts of Qwen3-30B-A3B's width, top-2: the tiles do not depend on how many
        num, width, top = 8, 768, 2
        w_gate_up = torch.empty(num, 2 * width, hidden, dtype=dtype)
        w_down = torch.empty(num, hidden, width, dtype=dtype)
        adapter = None if rank is None else (
            (torch.empty(num, rank, hidden), torch.empty(num, 2 * width, rank), 1.0),
            (torch.empty(num, rank, width), torch.empty(num, hidden, rank), 1.0))
        ids = torch.arange(tokens * top).remainder(num).view(tokens, top)
        return lambda: fused_moe(torch.empty(tokens, hidden, dtype=dtype), w_gate_up, w_down,
                                 torch.ones(tokens, top), ids, act, adapter,
                                 invariant=invariant)

    return [
        ("store_kv 512 tokens", store(512)),
        ("prefill 1 x 2048", attention([2048], [2048])),
        ("extend 2 x 512 over 4096", attention([512] * 2, [4096] * 2)),
        ("chunk 1024 + 63 decodes", attention([1024] + [1] * 63, [3072] + [2000] * 63)),
        ("decode 1 x 8192 (split-KV)", attention([1], [8192])),
        ("decode 256 x 2048", attention([1] * 256, [2048] * 256)),
        ("verify 8 x (4+1) over 1024", attention([5] * 8, [1024] * 8)),
        ("shared prefix 4 groups x 8, 1024 + 64", shared_prefix(4, 8, 1024, 64)),
        # Sliding-window layers (Mistral, Gemma 2/3) and soft-capped scores (Gemma 2).
        ("window 1024: prefill 1 x 2048", attention([2048], [2048], window=1024)),
        ("window 1024: decode 256 x 2048", attention([1] * 256, [2048] * 256, window=1024)),
        ("window 4096 softcap: decode 1 x 8192 (split-KV)",
         attention([1], [8192], window=4096, softcap=50.0)),
        ("softcap: extend 2 x 512 over 4096", attention([512] * 2, [4096] * 2, softcap=50.0)),
        ("softcap: shared prefix 4 groups x 8", shared_prefix(4, 8, 1024, 64, softcap=50.0)),
        ("sample 64 rows", sampler(64)),
        ("noise 64 rows", noise(64)),
        ("accept coupled", accept(40, False)),
        ("accept rejection", accept(40, True)),
        ("lora rank 16: decode 256", lora(256, 16, "ieee")),
        ("experts: decode 64 tokens", experts(64, False)),
        ("experts: prefill 2048 tokens, GELU, adapter rank 16",
         experts(2048, False, 16, "gelu_pytorch_tanh")),
        # EngineConfig(batch_invariant=True): one configuration whatever the row count
        ("invariant: projection decode 256", projection(256)),
        ("invariant: projection prefill 2048", projection(2048)),
        ("invariant: rms_norm 256 rows", norm(256, False)),
        ("invariant: rms_norm (1 + w) 256 rows", norm(256, True)),
        ("invariant: experts decode 64 tokens", experts(64, True)),
        ("logprob row sums 64 rows", row_sums(64)),
    ]


def all_kernels() -> set[str]:
    """Every Triton kernel of rollout_kernels.triton: the module-level `..._kernel`s."""
    import pkgutil

    import rollout_kernels.triton as package

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = sys.modules.get(f"{package.__name__}.{info.name}") or __import__(
            f"{package.__name__}.{info.name}", fromlist=["_"])
        names |= {name for name, value in vars(module).items()
                  if isinstance(value, JITFunction) and name.endswith("_kernel")}
    return names


def tile_sweep_cases() -> list[tuple[str, Callable[[], object]]]:
    """The tiles bench/triton_kernels.py sweeps on the GPU (Llama-3-8B heads, bf16), so a tile the
    GPU cannot launch is known before the device time is spent."""
    from triton_kernels import HEAD_DIM, KV_HEADS, Q_HEADS, TILE_SWEEP  # bench/ is sys.path[0]
    from rollout_kernels.triton.paged_attention import launch_paged_attention

    pool_k = torch.empty(4096, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    slots = torch.zeros(4096, dtype=torch.int32)
    cases = []
    for name, q_lens, kv_lens, tiles in TILE_SWEEP:
        q = torch.empty(sum(q_lens), Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        for tile in tiles:
            cases.append((f"tile sweep {name} {tile}", functools.partial(
                launch_paged_attention, q, pool_k, pool_k, torch.empty_like(q), _indptr(q_lens),
                _indptr(kv_lens), slots, sm_scale=HEAD_DIM ** -0.5, max_q_len=max(q_lens),
                max_kv_len=max(kv_lens), causal=True, num_kv_splits=1, tile=tile)))
    return cases


def report(target_name: str, recorder: Recorder) -> int:
    """Prints the variants; returns how many engine variants the target cannot launch."""
    t = recorder.target
    print(f"\n== {target_name} (sm_{t.arch}, {t.sms} SMs): {t.smem_per_block // 1024} KiB shared "
          f"memory per block, {t.max_warps_per_sm} warps per SM ==")
    print(f"{'kernel':<24} {'warps':>5} {'stages':>6} {'shared':>9} {'regs':>5} {'spill':>5} "
          f"{'occ':>5}  verdict")
    over = 0
    for v in sorted(recorder.variants.values(), key=lambda v: (v.kernel, -v.shared)):
        fits = v.shared <= t.smem_per_block
        over += v.engine and not fits
        verdict = "ok" if fits else "OVER the shared-memory limit"
        if not fits and not v.engine:
            verdict += " (the tile sweep will skip it)"
        elif v.spill:
            verdict = "ok, spills registers"
        occ = 100 * v.resident_warps(t) / t.max_warps_per_sm if fits else 0
        print(f"{v.kernel:<24} {v.num_warps:>5} {v.num_stages:>6} {v.shared / 1024:>6.1f} KiB "
              f"{v.regs:>5} {v.spill:>5} {occ:>4.0f}%  {verdict}")
        consts = " ".join(f"{k}={c}" for k, c in v.constexprs.items() if c is not None)
        print(f"    {consts}")
        shown = v.cases if len(v.cases) <= 4 else v.cases[:3] + [f"... {len(v.cases) - 3} more"]
        print("    used by: " + "; ".join(shown))
    print(f"{len(recorder.variants)} variants; {over} that an engine step launches do not fit")
    return over


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="h200", choices=[*TARGETS, "all"])
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of " + ", ".join(MODELS))
    ap.add_argument("--dtypes", default="bfloat16", help="comma list: bfloat16,float16,float32")
    ap.add_argument("--tiles", action="store_true", help="also the tiles bench/triton_kernels.py sweeps")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    for m in models:
        if m not in MODELS:
            ap.error(f"--models: unknown model {m!r}; known: {', '.join(MODELS)}")
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]

    if triton.knobs.runtime.interpret:
        raise RuntimeError("triton was imported under its interpreter; run this as a script, "
                           "in its own process")

    failures = 0
    for name in TARGETS if args.target == "all" else [args.target]:
        recorder = Recorder(TARGETS[name])
        cases = [(f"{m} {str(dt).removeprefix('torch.')}: {case}", launch, True)
                 for m in models for dt in dtypes for case, launch in engine_cases(m, dt)]
        if args.tiles:
            cases += [(case, launch, False) for case, launch in tile_sweep_cases()]
        for case, launch, engine in cases:
            recorder.case, recorder.engine = case, engine
            try:
                with recorder.launching_as_target():
                    launch()
            except HostRead as e:
                print(f"HOST READ in {case}: {e}")
                failures += 1
        failures += report(name, recorder)
        for kernel in sorted(all_kernels() - {v.kernel for v in recorder.variants.values()}):
            print(f"NOT COMPILED: {kernel} (no case launches it: add one to engine_cases)")
            failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
