"""Projections, and the CPU backend's packed copies of their weights: fp32 weights in panels
for rollout_kernels.cpu's linear.c where it builds, else (bf16 too, where the CPU has the
instructions) oneDNN's blocked layout.

At decode batch sizes (tens of rows) a CPU `F.linear` is slow for how it walks the weight, not
for memory: the packed layouts keep the weight's reads sequential (docs/benchmarks.md has the
figures). The oneDNN copy is the one torch's own compiler makes when it freezes a CPU model;
both differ from `F.linear` by fp32 rounding only, and each row's result does not depend on the
other rows.

The packed copy is derived from the weight, like RoPE's tables: made when the engine is built,
made again after update_weights and wake_up (so memory_held is the same before and after the
first step), dropped at sleep. A projection also checks at every use that its weight's storage
and version (every in-place copy bumps it) are those it packed, and packs again if not, so no
path that changes a weight can leave a stale copy in use. It doubles the weights' memory on CPU
(memory_held counts it). Only where oneDNN has a kernel for the dtype: fp32 wherever torch is
built with oneDNN (measured on x86 AVX2), bf16 where the CPU has the instructions (AVX-512 BF16
/ AVX-NE-CONVERT); elsewhere and on GPUs projections are plain `F.linear`.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from rollout_kernels.cpu import linear as native_linear
from rollout_kernels.cpu import linear_amx as native_amx

from ...ops.op import always

# The row count oneDNN tunes the packed layout for: a decode step's batch is tens of rows (hints
# of 16 to 128 timed alike at 4 to 128 rows); the layout serves any row count, prefill included.
BATCH_HINT = 16


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN has a packed-weight kernel for this device and dtype."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def weight_key(weight: torch.Tensor) -> tuple:
    """What a derived copy of `weight` is valid for: its storage and version (every in-place
    copy bumps it). Tensors made under torch.inference_mode keep no version: their storage
    alone (a model built for inference is not written in place)."""
    return weight.data_ptr(), 0 if weight.is_inference() else weight._version


class PackedCopy:
    """A packed copy of one [out, in] weight and the (storage, version) it was made from; the
    subclasses pack and multiply."""

    __slots__ = ("packed", "key")

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.key: tuple | None = None

    # Whether _pack rewrites the stale copy in place where it fits (its address stays, and no
    # fresh buffer is made), rather than making a new one.
    in_place = False

    def refresh(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of `weight` as it is now."""
        key = weight_key(weight)
        if key != self.key:
            stale = self.packed if self.in_place else None
            self.drop()  # the stale copy goes before the new one is made (or is rewritten)
            # Packed at first use too, inside the runner's inference mode: a plain tensor
            # still, which a later update_weights (outside that mode) rewrites in place.
            with torch.inference_mode(False):
                self.packed = self._pack(weight.detach(), stale)
            self.key = key
        return self.packed

    def _pack(self, weight: torch.Tensor, stale: torch.Tensor | None) -> torch.Tensor:
        """The copy of `weight`, written into `stale` if given and it fits."""
        raise NotImplementedError

    def drop(self) -> None:
        self.packed = self.key = None


class PackedWeight(PackedCopy):
    """oneDNN's blocked layout."""

    __slots__ = ()
    kind = "onednn"

    def _pack(self, weight: torch.Tensor, stale: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.refresh(weight), bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        return 0 if self.packed is None else torch.ops.mkldnn._nbytes(self.packed)


class NativePackedWeight(PackedCopy):
    """fp32 panels for rollout_kernels.cpu's linear.c: faster than oneDNN's layout up to
    native_linear.MAX_ROWS rows; longer prefill chunks take F.linear, unless `all_rows`
    (batch-invariant: the panels for every row count, since F.linear's rows depend on it)."""

    __slots__ = ("all_rows",)
    kind = "cpu"

    def __init__(self, all_rows: bool = False) -> None:
        super().__init__()
        self.all_rows = all_rows

    def _pack(self, weight: torch.Tensor, stale: torch.Tensor | None) -> torch.Tensor:
        return native_linear.pack_panels(weight)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        k = weight.shape[1]
        long = not self.all_rows and x.numel() // k > native_linear.MAX_ROWS
        if long or x.dtype != torch.float32:
            return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        y = native_linear.linear(x, self.refresh(weight), weight.shape[0])
        return y if bias is None else y.add_(bias.to(y.dtype))

    @property
    def nbytes(self) -> int:
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()


class SmallPanels(NativePackedWeight):
    """NativePackedWeight for small weights (LoRA's A and B, lora.py), repacked in place on
    one thread: at their sizes a fresh buffer and a thread team cost more than the packing
    (measured: 45 us in place on one thread, 270-460 us fresh on two, for [960, 48])."""

    __slots__ = ()
    in_place = True

    def _pack(self, weight: torch.Tensor, stale: torch.Tensor | None) -> torch.Tensor:
        if stale is not None and stale.numel() != native_linear.panels_numel(weight.shape):
            stale = None
        return native_linear.pack_panels(weight, stale, threads=1)


class Float32Copy(PackedCopy):
    """The weight in float32, for logits computed in float32 from the hidden state
    (EngineConfig.lm_head_dtype): refreshed in place, so its address stays what CUDA graphs
    captured."""

    __slots__ = ()
    kind = "fp32"
    in_place = True

    def _pack(self, weight: torch.Tensor, stale: torch.Tensor | None) -> torch.Tensor:
        if stale is not None and stale.shape == weight.shape:
            return stale.copy_(weight)
        return weight.float().contiguous()

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x.float(), self.refresh(weight), None if bias is None else bias.float())

    @property
    def nbytes(self) -> int:
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()


class Float32Panels(NativePackedWeight):
    """The weight in float32 panels for linear.c (the CPU backend's fp32 head)."""

    __slots__ = ()
    kind = "cpu-fp32"

    def _pack(self, weight: torch.Tensor, stale: torch.Tensor | None) -> torch.Tensor:
        return native_linear.pack_panels(weight.float())

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        return super().linear(x.float(), weight, bias)


# The dtypes whose weights RoundedPanels multiplies in fp32 (their upcast is exact).
HALF = (torch.bfloat16, torch.float16)


class RoundedPanels(Float32Panels):
    """A bf16 or fp16 weight's projections in a batch-invariant engine: Float32Panels, x
    upcast, the result rounded to x's dtype once, after the bias. Every output element is one
    chain of FMAs whatever the row count (linear.c), where oneDNN's bf16 kernels are picked by
    it (with AMX they rounded a row unlike the same row in a larger call) and fp16's F.linear
    rounded a lone row unlike a batch's (tests/models/test_packed_linear.py). Twice the
    weights' memory, where oneDNN's bf16 copy holds once."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(all_rows=True)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        return super().linear(x, weight, bias).to(x.dtype)


class AmxPanels(NativePackedWeight):
    """A bf16 weight's projections in a batch-invariant engine on a CPU with AMX: the weight
    itself in tile-shaped panels (rollout_kernels.cpu.linear_amx), x's bf16 rows multiplied
    by them into fp32, each output element one chain whatever the row count, and the result
    rounded to bf16 once, after the bias, as RoundedPanels's. It holds the weights once where
    RoundedPanels holds them twice, and multiplies on the tiles, where oneDNN's default bf16
    kernels do too (docs/backends.md)."""

    __slots__ = ()
    kind = "cpu-amx"

    def __init__(self) -> None:
        super().__init__(all_rows=True)

    def _pack(self, weight: torch.Tensor, stale: torch.Tensor | None) -> torch.Tensor:
        return native_amx.pack_panels(weight)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        y = native_amx.linear(x, self.refresh(weight), *weight.shape)
        # (add_ reads a bf16 bias as fp32 itself: no fp32 copy of it a call)
        return (y if bias is None else y.add_(bias)).to(x.dtype)


class TritonRows(Float32Copy):
    """The Triton backend's batch-invariant projections (kernels/triton/row_invariant.py): the
    weight itself, multiplied by a kernel whose launch does not depend on the row count.
    `float32`: in float32 from a float32 copy of the weight (EngineConfig.lm_head_dtype),
    refreshed in place as Float32Copy's, so CUDA graphs keep its address (without `float32`
    nothing is copied: refresh hands back the weight)."""

    __slots__ = ("float32", "matmul")

    def __init__(self, float32: bool = False) -> None:
        super().__init__()
        from rollout_kernels.triton.row_invariant import linear

        self.float32, self.matmul = float32, linear

    @property
    def kind(self) -> str:
        return "triton-invariant-fp32" if self.float32 else "triton-invariant"

    def refresh(self, weight: torch.Tensor) -> torch.Tensor:
        return super().refresh(weight) if self.float32 else weight

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        x = x.float() if self.float32 else x
        return self.matmul(x, self.refresh(weight), None if bias is None else bias.to(x.dtype))


def invariant_packing(dtype: torch.dtype) -> PackedCopy:
    """The packing of a batch-invariant engine's projections on the CPU: linear.c's panels
    for every row count (its intrinsics or its portable C), row-invariant by construction; a
    bf16 weight's on AMX's tiles (AmxPanels) where the CPU has them, else, as an fp16
    weight's, in fp32 (RoundedPanels), since oneDNN's half-precision kernels and F.linear are
    not (tests/models/test_packed_linear.py). resolve_backend refuses the mode
    where linear.c did not build."""
    if dtype == torch.bfloat16 and native_amx.supported(torch.device("cpu")):
        return AmxPanels()
    if dtype in HALF:
        return RoundedPanels()
    return NativePackedWeight(all_rows=True)


def packing_for(backend, dtype: torch.dtype, implementations) -> PackedCopy | None:
    """A new packed copy for one weight of a layer with these `implementations` under
    `backend` (None: F.linear): the invariant packing in a batch-invariant engine, the panels
    (else oneDNN's layout) where the cpu backend packs weights."""
    if backend.triton_rows:
        return TritonRows()
    if backend.batch_invariant:
        return invariant_packing(dtype)
    if backend.choose(implementations, dtype) == "cpu" and backend.pack_weights:
        fast = native_linear.supported(backend.device, dtype)
        return NativePackedWeight() if fast else PackedWeight()
    return None


class Projection:
    """Mixin of the model's projections (nn.Linear subclasses and the LM head): `project`
    multiplies by the weight, or by its packed copy under the cpu backend (use_backend)."""

    implementations = {"torch": always, "cpu": can_pack}
    packing = None  # a PackedCopy: PackedWeight, NativePackedWeight, Float32Copy, ...
    # An unmerged LoRA adapter (lora.py) is served here: its LoraWeights is the submodule
    # `lora` (a class attribute of that name would shadow the submodule), set by rollout/lora/.
    lora_active = False

    def use_backend(self, backend, dtype: torch.dtype) -> None:
        self.packing = packing_for(backend, dtype, self.implementations)

    def compute_in_float32(self, backend) -> None:
        """Multiply in float32 whatever the weight's dtype (a float32 copy of it, derived like
        the packed ones; EngineConfig.lm_head_dtype for the LM head)."""
        if backend.triton_rows:
            self.packing = TritonRows(float32=True)
            return
        if backend.batch_invariant:  # the cpu backend's (resolve_backend checked linear.c)
            self.packing = Float32Panels(all_rows=True)
            return
        fast = backend.name == "cpu" and native_linear.supported(backend.device, torch.float32)
        self.packing = Float32Panels() if fast else Float32Copy()

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packing is None:
            y = F.linear(x, self.weight, bias)
        else:
            y = self.packing.linear(x, self.weight, bias)
        return self.lora.add_to(x, y) if self.lora_active else y

    def pack(self) -> None:
        if self.packing is not None:
            self.packing.refresh(self.weight)

    def drop_derived(self) -> None:
        if self.packing is not None:
            self.packing.drop()

    def derived_bytes(self) -> int:
        return 0 if self.packing is None else self.packing.nbytes
