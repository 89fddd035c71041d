"""Sleep and wake: give the trainer back the memory the engine holds between rollouts.

Level 1 drops the KV pool and moves the weights to host memory (pinned on CUDA, so waking is
one fast copy). Level 2 drops the weights too; `update_weights` must refill them before the
next generate. Parameters keep their identity across a cycle (their `.data` is swapped), so
modules and optimizers that hold them stay valid; device addresses do change, which matters
only to captured CUDA graphs: the engine drops its graphs at sleep and captures them again.

On CPU host memory is device memory, so level 1 normally leaves the weights where they are.
`EngineConfig(extra={"separate_host_memory": True})` (for tests) makes a CPU engine treat its
memory as a GPU's, separate from the host's: level 1 then copies the weights into host buffers
and frees the device's, wake_up copies them back, and update_weights moves every tensor through
the bucketed transfer (weights.buckets). The code that runs is the GPU's; only the copies are
host to host.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import SEPARATE_HOST_MEMORY
from .device_memory import host_copy, tensor_bytes


def separate_host_memory(extra: dict, device: torch.device) -> bool:
    """Whether the device's memory is not the host's: on a GPU, or on CPU when `extra` asks
    (EngineConfig checked it is a bool)."""
    return device.type != "cpu" or extra.get(SEPARATE_HOST_MEMORY, False)


class WeightParking:
    def __init__(self, model: nn.Module, device: torch.device,
                 separate_host: bool | None = None) -> None:
        """`separate_host`: level 1 copies the weights to host buffers (None: unless the
        device is the CPU, whose memory is the host's)."""
        self.model, self.device = model, device
        self.separate_host = device.type != "cpu" if separate_host is None else separate_host
        self.host: dict[str, torch.Tensor] = {}
        self.dropped: dict[str, tuple[torch.Size, torch.dtype]] = {}

    def park(self, level: int) -> None:
        """Level 1: weights to host memory. Level 2: weights dropped, also those a level-1
        park put on the host (deepening touches no device memory). Parameters already parked
        are skipped, so a park that failed half way can be run again."""
        to_host = self.separate_host  # else they are in host memory already (CPU)
        for name, t in self.model.named_parameters():
            if name in self.dropped:
                continue
            if level == 2:
                self.dropped[name] = (self.host.pop(name, t).shape, t.dtype)
            elif to_host and name not in self.host:
                self.host[name] = host_copy(t.data)
            else:
                continue
            t.data = torch.empty(0, dtype=t.dtype, device=self.device)

    @property
    def dropped_any(self) -> bool:
        return bool(self.dropped)

    @property
    def host_bytes(self) -> int:
        """Bytes of the weights parked in host memory (level 1 on a separate device)."""
        return tensor_bytes(self.host.values())

    def restore(self) -> None:
        """Weights back on the device, one at a time: a restore that failed half way leaves
        the rest parked, to be restored (or parked again) later."""
        for name, t in self.model.named_parameters():
            if name in self.host:
                # copy=True: a new device tensor also where the host's memory is the device's
                # (the CPU seam), as a host-to-GPU copy makes; the host buffer is then freed.
                t.data = self.host[name].to(self.device, non_blocking=True, copy=True)
                del self.host[name]
            elif name in self.dropped:
                # Uninitialised until update_weights fills them; generate refuses until then.
                shape, dtype = self.dropped[name]
                t.data = torch.empty(shape, dtype=dtype, device=self.device)
                del self.dropped[name]
