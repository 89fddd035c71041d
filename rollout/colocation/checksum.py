"""Verified weight copies: every tensor update_weights writes is summed on the source side
and read back on the destination, on the device, and a bucket's sums are compared with one
host synchronisation. The sum is of the values' bit patterns as 32-bit words, wrapping
(exact modulo 2^32, so the order the device adds in does not matter, and one flipped bit
always changes it); 32-bit words because integer sums that narrow run at memory speed where
widening ones do not. The destination is also checked for non-finite values (its min and max,
one pass), which a NaN or Inf in the source, or a finite float32 too large for bf16, leaves.

On the CPU a same-dtype contiguous copy takes rollout_kernels.cpu's checked_copy instead:
the same sums and check in the copy's one pass over memory (each block read back while it is
in the cache), where the torch passes read everything three more times.

A mismatch or a non-finite value raises after the bucket's copy: the engine's weights are then
incomplete (`needs_weights`), and it refuses to generate until a complete update_weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout_kernels.cpu import checked_copy as native_copy

# The integer type of each floating dtype's width: a tensor viewed as it, bit for bit.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_sum(t: torch.Tensor) -> torch.Tensor:
    """The wrapping sum of `t`'s bits as 32-bit words (8-byte dtypes: 64-bit words), a 0-d
    tensor on its device; the same for the same values whatever `t`'s layout."""
    if t.element_size() == 4 and t.is_contiguous():  # float32: its words as they lie
        return t.view(torch.int32).sum(dtype=torch.int32)
    flat = t.contiguous().view(-1)
    size = flat.element_size()
    word = torch.int64 if size == 8 else torch.int32
    per = max(1, 4 // size)
    whole = flat.numel() - flat.numel() % per
    try:
        words = flat[:whole].view(word)
    except RuntimeError:  # an offset a 32-bit view cannot start at
        words = flat[:whole].clone().view(word)
    total = words.sum(dtype=word)
    if whole < flat.numel():  # the odd element or three of a narrow dtype
        total = total + flat[whole:].view(_BITS[size]).sum(dtype=word)
    return total


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The copy itself (its own function so a test can corrupt it)."""
    dst.copy_(src)


def _native_copy(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, bool]:
    """The C kernel's checked copy (its own function so a test can corrupt it)."""
    return native_copy.checked_copy(dst, src)


class CopyMismatch(RuntimeError):
    """A weight differs from its source after the copy."""


@dataclass
class Checked:
    """The checks of one bucket's copies, compared at `verify`."""

    names: list[str] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)
    destinations: list[torch.Tensor] = field(default_factory=list)
    finite: list[torch.Tensor] = field(default_factory=list)

    def copy(self, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src), recording both sides' sums (the source's in dst's dtype: what the
        copy must leave in dst)."""
        if src.dtype != dst.dtype:
            src = src.to(dst.dtype)
        self.names.append(name)
        if native_copy.supported(dst, src):
            source, written, finite = _native_copy(dst, src)
            self.sources.append(torch.tensor(source, dtype=torch.int32))
            self.destinations.append(torch.tensor(written, dtype=torch.int32))
            self.finite.append(torch.tensor(finite))
            return
        self.sources.append(bit_sum(src))
        _copy(dst, src)
        self.destinations.append(bit_sum(dst))
        self.finite.append(torch.isfinite(torch.stack(torch.aminmax(dst))).all())

    def verify(self) -> None:
        """Raise for the first weight whose copy differs from its source or holds a non-finite
        value (ValueError: the source's fault; RuntimeError: the copy's)."""
        if not self.names:
            return
        finite = torch.stack(self.finite)
        same = torch.stack(self.sources) == torch.stack(self.destinations)
        finite, same = finite.cpu(), same.cpu()  # one synchronisation a bucket
        if not bool(finite.all()):
            raise _non_finite(self.names[int((~finite).nonzero()[0])])
        if not bool(same.all()):
            raise _mismatch(self.names[int((~same).nonzero()[0])])
        for checks in (self.names, self.sources, self.destinations, self.finite):
            checks.clear()


def copy_all_verified(copies: list[tuple[str, torch.Tensor, torch.Tensor]],
                      covers: list[torch.Tensor]) -> None:
    """Many small copies (name, dst, src) checked as one: the bit sums of the sources against
    those of `covers`, the destination tensors the copies fill, whole (anything else they hold
    must be +0.0, whose bits add nothing), and the covers' value sums for non-finite values (a
    NaN or Inf makes its sum so; large finite values can too, and are then cleared copy by
    copy). Nothing is concatenated: that would allocate, and page-fault on CPU, as much as it
    checks. A mismatch is traced to its weight copy by copy, as `Checked` would name it."""
    if not copies:
        return
    dtype = covers[0].dtype
    word = torch.int64 if dtype.itemsize == 8 else torch.int32
    sources = []
    for _, dst, src in copies:
        src = src.to(dtype)
        sources.append(bit_sum(src))
        _copy(dst, src)
    written = torch.stack([bit_sum(c) for c in covers]).sum(dtype=word)
    finite = torch.isfinite(torch.stack([c.sum() for c in covers]).sum())
    if bool(finite) and bool(torch.stack(sources).sum(dtype=word) == written):
        return
    for name, dst, src in copies:
        if not bool(torch.isfinite(dst).all()):
            raise _non_finite(name)
        if not bool(bit_sum(dst) == bit_sum(src.to(dst.dtype))):
            raise _mismatch(name)
    if not bool(torch.stack(sources).sum(dtype=word) == written):
        raise _mismatch(copies[0][0].rsplit(".", 1)[0] + " (outside the copied blocks)")


def _non_finite(name: str) -> ValueError:
    return ValueError(f"update_weights: weight {name!r} holds non-finite values (nan or inf) "
                      f"in the engine's dtype (written: the engine's weights are unusable and "
                      f"it refuses to generate until a complete update_weights)")


def _mismatch(name: str) -> CopyMismatch:
    return CopyMismatch(f"update_weights: weight {name!r} differs from its source after the "
                        f"copy (checksum mismatch); the engine's weights are incomplete and it "
                        f"refuses to generate until a complete update_weights")
