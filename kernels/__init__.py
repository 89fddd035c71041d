"""Triton kernels of the rollout engine and the torch references they are tested against.

Importing this package never needs CUDA. On a machine without a GPU (and without an explicit
choice) it turns on Triton's CPU interpreter, so the kernels run there too, slowly: this has to
happen before any kernel module is decorated by triton.jit, hence here, first.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from .counter_noise import gumbel_noise_triton  # noqa: E402
from .merge_states import merge_states  # noqa: E402
from .paged_attention import (  # noqa: E402
    choose_num_kv_splits,
    paged_attention,
    paged_attention_ref,
)
from .sample import sample  # noqa: E402
from .shared_prefix import shared_prefix_attention  # noqa: E402
from .spec_accept import accept_drafts  # noqa: E402
from .store_kv import store_kv, store_kv_ref  # noqa: E402

__all__ = [
    "accept_drafts",
    "choose_num_kv_splits",
    "gumbel_noise_triton",
    "merge_states",
    "paged_attention",
    "paged_attention_ref",
    "sample",
    "shared_prefix_attention",
    "store_kv",
    "store_kv_ref",
]
