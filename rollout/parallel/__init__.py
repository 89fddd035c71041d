"""Tensor parallelism over torch.distributed: the group (group.py), the collectives a sharded
forward issues (collectives.py), which part of each checkpoint tensor a rank keeps (shard.py),
the group a model is being built for (building.py), and what the ranks must agree on before
they run together: config, pool size, each call's requests (agree.py)."""

from .building import building_for, current
from .collectives import all_reduce, check_same_batch, check_same_tokens, gather_vocab
from .group import SINGLE, TensorParallel, shared_seed, tensor_parallel
from .shard import Concat, HeadSplit, Slice, even_split, split_heads, split_vocab

__all__ = ["SINGLE", "Concat", "HeadSplit", "Slice", "TensorParallel", "all_reduce",
           "building_for", "check_same_tokens", "current", "even_split", "gather_vocab",
           "shared_seed", "split_heads", "split_vocab", "tensor_parallel"]
