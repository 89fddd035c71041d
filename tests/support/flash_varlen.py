"""CPU stand-ins for what TRL's AsyncGRPOTrainer takes from the GPU, so it can train in CI: the
flash-attention kernel its tree packing calls (fetched by the `kernels` package at run time, CUDA
only) as a torch reference, and the peak-FLOPs lookup its MFU metric makes (torch.cuda).

`flash_attn_varlen_func` follows flash-attention's contract: packed [T, heads, dim] queries and
keys with cumulative sequence lengths, grouped-query heads, and causal masking aligned to the
bottom right (query i of a segment of Lq sees keys j <= i + Lk - Lq), the way a tree-packed
completion attends to its shared prompt."""

from __future__ import annotations

import math
import sys
import types
from importlib import metadata

import torch


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0):
    if window_size != (-1, -1) or softcap:
        raise NotImplementedError("sliding windows and soft-capping are not needed here")
    scale = softmax_scale or 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        qb = q[qs:qe].transpose(0, 1).float()  # [H, Lq, D]
        kb = k[ks:ke].transpose(0, 1).float().repeat_interleave(group, 0)
        vb = v[ks:ke].transpose(0, 1).float().repeat_interleave(group, 0)
        scores = qb @ kb.transpose(1, 2) * scale
        if causal:
            lq, lk = qe - qs, ke - ks
            allowed = (torch.arange(lk)[None, :]
                       <= torch.arange(lq)[:, None] + (lk - lq)).to(scores.device)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = (scores.softmax(-1) @ vb).transpose(0, 1).to(q.dtype)
    return out


def install(monkeypatch) -> None:
    """TRL fetches the kernel with `kernels.get_kernel`: patched on Hugging Face's hub `kernels`
    where it is installed (transformers >= 5.25 depends on it and imports the rest of it),
    else on a stand-in module of that name."""
    try:
        metadata.version("kernels")
        import kernels
    except metadata.PackageNotFoundError:
        kernels = types.ModuleType("kernels")
        monkeypatch.setitem(sys.modules, "kernels", kernels)
    monkeypatch.setattr(kernels, "get_kernel", lambda *args, **kwargs: types.SimpleNamespace(
        flash_attn_varlen_func=flash_attn_varlen_func), raising=False)
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    packing._flash_attn.cache_clear()
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *a, **k: 1e12)
