"""Device memory handed back to the driver after sleep, host copies of device tensors, and the
bytes a set of tensors holds."""

from __future__ import annotations

import torch


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached workspaces. torch keeps one per (handle, stream), allocated through
    the caching allocator and never freed (32 MiB each on Hopper): a new stream (a CUDA graph's
    warm-up, its capture) leaves one behind for good, and one made during a capture pins that
    graph's private pool. The next matmul on a stream allocates its workspace again."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private, hence the guard
    if clear is not None:
        clear()


def release_cuda_cache(device: torch.device) -> None:
    """After sleep freed the pool and weights: hand the cached blocks and cuBLAS workspaces back
    to the driver, so the trainer sees the memory free."""
    torch.cuda.synchronize(device)
    clear_cublas_workspaces()
    torch.cuda.empty_cache()


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory: pinned when `t` is on a GPU, so that the copy back to the
    device can run asynchronously."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
    host.copy_(t)
    return host


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
