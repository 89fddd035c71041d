"""The kernels of the rollout engine, one leaf package the engine calls into (it imports nothing
from `rollout`):

- `rollout_kernels.triton`: Triton kernels for the CUDA backend, and the torch references they
  are tested against. Importing it imports triton.
- `rollout_kernels.cpu`: C kernels for the CPU backend, compiled at first use with the machine's
  C compiler, cached, and called through ctypes.

Importing this package itself imports neither and changes nothing in the process.
"""
