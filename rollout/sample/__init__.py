"""Sampling: the per-request parameters (params.py), the sampler (sampler.py) with its top-k /
top-p / min-p filters (filters.py) and counter-based noise (noise.py)."""
