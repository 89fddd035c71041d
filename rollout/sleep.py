"""Sleep and wake: give the trainer back the memory the engine holds between rollouts.

Level 1 drops the KV pool and moves the weights to host memory (pinned on CUDA, so waking is
one fast copy). Level 2 drops the weights too; `update_weights` must refill them before the
next generate. Parameters keep their identity across a cycle (their `.data` is swapped), so
modules and optimizers that hold them stay valid; device addresses do change, which matters
only to captured CUDA graphs: the engine drops its graphs at sleep and captures them again.
"""

from __future__ import annotations

import torch
from torch import nn


class WeightParking:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self.host: dict[str, torch.Tensor] = {}
        self.dropped: dict[str, tuple[torch.Size, torch.dtype]] = {}

    def park(self, level: int) -> None:
        """Level 1: weights to host memory. Level 2: weights dropped, also those a level-1
        park put on the host (deepening touches no device memory). Parameters already parked
        are skipped, so a park that failed half way can be run again."""
        to_host = self.device.type != "cpu"  # on CPU host memory is where they already are
        for name, t in self.model.named_parameters():
            if name in self.dropped:
                continue
            if level == 2:
                self.dropped[name] = (self.host.pop(name, t).shape, t.dtype)
            elif to_host and name not in self.host:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.device.type == "cuda")
                host.copy_(t.data)
                self.host[name] = host
            else:
                continue
            t.data = torch.empty(0, dtype=t.dtype, device=self.device)

    @property
    def dropped_any(self) -> bool:
        return bool(self.dropped)

    def restore(self) -> None:
        """Weights back on the device, one at a time: a restore that failed half way leaves
        the rest parked, to be restored (or parked again) later."""
        for name, t in self.model.named_parameters():
            if name in self.host:
                t.data = self.host[name].to(self.device, non_blocking=True)
                del self.host[name]
            elif name in self.dropped:
                # Uninitialised until update_weights fills them; generate refuses until then.
                shape, dtype = self.dropped[name]
                t.data = torch.empty(shape, dtype=dtype, device=self.device)
                del self.dropped[name]


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
