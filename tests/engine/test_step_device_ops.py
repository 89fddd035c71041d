"""A decode step issues the same device ops at any batch size. On a GPU every op is a kernel
launch or a transfer from the host: per-sequence ops in scheduling or bookkeeping would make a
step of a large GRPO batch launch-bound however fast the forward is."""

from collections import Counter

import pytest
from models import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from rollout import Engine, EngineConfig, SamplingParams


class DeviceOps(TorchDispatchMode):
    """Counts the ops that reach a device; views only reinterpret memory."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def decode_step_ops(batch: int, n: int) -> Counter:
    engine = Engine(tiny_model("qwen2"), EngineConfig(kv_cache_tokens=4096, max_model_len=64,
                                                      max_num_seqs=128))
    for i in range(batch // n):
        engine.add_request([1, 2, 3, 4 + i], SamplingParams(
            n=n, max_tokens=20, ignore_eos=True, temperature=1.0, seed=i, logprobs=True))
    for _ in range(4):  # prefill, then siblings admitted on the cached prompt, then decodes
        engine.step()
    assert len(engine.scheduler.running) == batch
    assert not any(s.is_prefilling for s in engine.scheduler.running)
    with DeviceOps() as counter:
        engine.step()
    return counter.ops


@pytest.mark.parametrize("n", [1, 4])
def test_decode_step_device_ops_do_not_grow_with_the_batch(n):
    small, large = decode_step_ops(8, n), decode_step_ops(64, n)
    grown = {op: (small[op], large[op]) for op in small | large if small[op] != large[op]}
    assert not grown, f"ops per step at batch 8 vs 64: {grown}"
