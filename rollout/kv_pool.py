"""The KV pool: one allocation for every layer's K and V, and the free-slot stack.

Page size is 1: a slot holds one token's K and V in every layer. Slots live as int64 tensors on
the pool's device so allocation, freeing and metadata building never leave the device.
"""

from __future__ import annotations

import os

import torch


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def size_pool(kv_cache_tokens: int | None, memory_fraction: float, max_model_len: int,
              max_num_seqs: int, bytes_per_token: int, device: torch.device) -> int:
    """Number of slots; refuses (ValueError) when one max_model_len request cannot fit."""
    if kv_cache_tokens is None:
        budget = int(available_memory(device) * memory_fraction)
        # More than every sequence at full length could never be used.
        kv_cache_tokens = min(budget // bytes_per_token, max_num_seqs * max_model_len)
    if kv_cache_tokens < max_model_len:
        raise ValueError(
            f"kv_cache_tokens: the KV pool holds {kv_cache_tokens} tokens "
            f"({kv_cache_tokens * bytes_per_token / 2**20:.1f} MiB) but one request of "
            f"max_model_len={max_model_len} tokens needs {max_model_len} "
            f"({max_model_len * bytes_per_token / 2**20:.1f} MiB); raise kv_cache_tokens or "
            f"kv_memory_fraction, or lower max_model_len")
    return kv_cache_tokens


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.num_slots = num_layers, num_slots
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.buffer: torch.Tensor | None = None
        self.allocate()

    # --- memory -----------------------------------------------------------------------------
    def allocate(self) -> None:
        shape = (2, self.num_layers, self.num_slots, self.kv_heads, self.head_dim)
        self.buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._free = torch.arange(self.num_slots, dtype=torch.int64, device=self.device)
        self._num_free = self.num_slots

    def release(self) -> None:
        """Drop the whole pool (sleep); every slot is gone with it."""
        self.buffer = None
        self._free = None
        self._num_free = 0

    @property
    def is_allocated(self) -> bool:
        return self.buffer is not None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def k(self, layer: int) -> torch.Tensor:
        return self.buffer[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer]

    # --- slots ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._num_free:
            raise RuntimeError(f"KV pool: asked for {n} slots, {self._num_free} free")
        self._num_free -= n
        return self._free[self._num_free:self._num_free + n].clone()

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n:
            self._free[self._num_free:self._num_free + n] = slots
            self._num_free += n

    def unfree(self, slots: torch.Tensor) -> None:
        """Undo the latest `free(slots)` (rolling a failed step back, newest change first):
        they are still the top of the free stack, since every later change was undone."""
        self._num_free -= slots.numel()

    def free_slots(self) -> torch.Tensor:
        return self._free[:self._num_free]
