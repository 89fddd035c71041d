"""Attention over the paged KV pool: the backend interface (base.py) and the flat step metadata
it reads (metadata.py); the torch reference (sdpa.py, with the shared-prefix split of
shared_prefix.py), the CPU backend on a C kernel (cpu.py), the Triton backend (triton.py); which
one an engine runs (registry.py)."""
