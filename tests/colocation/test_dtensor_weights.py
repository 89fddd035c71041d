"""update_weights from a model whose parameters are DTensor shards (FSDP2 / tensor parallel)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank_group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_update_weights_gathers_dtensor_shards(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=10)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    engine = Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64))
    before = engine.generate(prompts, params)
    changed = tiny_model("llama", seed=1)
    expected = Engine(changed, EngineConfig(kv_cache_tokens=512, max_model_len=64))
    expected = expected.generate(prompts, params)
    mesh = init_device_mesh("cpu", (1,))
    with torch.no_grad():
        for name, p in list(changed.named_parameters()):
            module = changed.get_submodule(name.rsplit(".", 1)[0])
            shard = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
            setattr(module, name.rsplit(".", 1)[1], shard)
    assert any(hasattr(p, "full_tensor") for p in changed.parameters())
    engine.update_weights(changed)
    after = engine.generate(prompts, params)
    assert [o.samples[0].token_ids for o in after] == [o.samples[0].token_ids for o in expected]
    assert [o.samples[0].token_ids for o in after] != [o.samples[0].token_ids for o in before]


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_an_optimizer_step_on_dtensor_shards_is_a_weight_change(foreach, one_rank_group):
    """FSDP2's parameters are DTensors, and a foreach optimizer step on them (torch's default
    on CUDA) moves no version counter, the DTensor's or its shard's: weights_version stood
    still, and ColocatedRollout served the weights of before the step. After it, the engine
    generates what a fresh engine built from the stepped weights does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer_hooks import ColocatedRollout

    model = tiny_model("llama")
    mesh = init_device_mesh("cpu", (1,))
    for name, p in list(model.named_parameters()):
        module, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(module), attr,
                torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    config = EngineConfig(kv_cache_tokens=512, max_model_len=64)
    engine = Engine(tiny_model("llama", seed=1), config)
    rollout = ColocatedRollout(engine, model, synced=False)
    with rollout:
        pass
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=foreach)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=True)
    with rollout:
        assert rollout.synced
        outs = rollout.generate([[1, 2, 3]], params)
    stepped = tiny_model("llama")
    stepped.load_state_dict({n: p.full_tensor() for n, p in model.named_parameters()})
    want = Engine(stepped, config).generate([[1, 2, 3]], params)
    assert [(s.token_ids, s.logprobs) for o in outs for s in o.samples] == \
        [(s.token_ids, s.logprobs) for o in want for s in o.samples]
