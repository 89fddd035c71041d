"""Triton kernels of the rollout engine and the torch references they are tested against.

Importing this package needs triton, not CUDA. Off CUDA the kernels run in Triton's CPU
interpreter only if the process set TRITON_INTERPRET=1 before this package was first imported
(triton.jit reads it when it decorates a kernel); this package never sets it.
"""

from .counter_noise import gumbel_noise_triton
from .lora import lora_add_ref, lora_expand_add, lora_shrink
from .merge_states import merge_states
from .paged_attention import choose_num_kv_splits, paged_attention, paged_attention_ref
from .sample import sample
from .shared_prefix import shared_prefix_attention
from .spec_accept import accept_drafts
from .store_kv import store_kv, store_kv_ref

__all__ = [
    "accept_drafts",
    "choose_num_kv_splits",
    "gumbel_noise_triton",
    "lora_add_ref",
    "lora_expand_add",
    "lora_shrink",
    "merge_states",
    "paged_attention",
    "paged_attention_ref",
    "sample",
    "shared_prefix_attention",
    "store_kv",
    "store_kv_ref",
]
