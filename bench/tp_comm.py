"""Communication of one tensor-parallel decode step: how many collectives, of which kind, how
many bytes, counted on the torch.distributed calls themselves (every call is wrapped, so a
collective nobody meant to issue shows up too).

Workload: a random-weight Llama of about SmolLM2-135M's shapes (hidden 576, MLP 1536, vocab
49152, but 8 query heads so that 2 and 4 ranks divide them, and 2 KV heads: split at TP=2,
replicated at TP=4), --layers layers, --batch requests decoding side by side; forked CPU ranks
on gloo.
Expected per decode step: 2 all-reduces per layer (after o_proj and down_proj) + 1 (the
vocabulary-parallel embedding) and 1 all-gather of the logits rows, plus the check that the
ranks run the same batch (check_same_batch: one MAX all-reduce of two int64s, counted apart
from the forward's sums and left out of their bytes); nothing else. Rank 0 prints what it
counted (every rank issues the same calls). Then one update_weights from the model sharded as
FSDP2 shards it (DTensor Shard(0) over the tp ranks): collectives and bytes received per rank,
against gathering each weight whole. No timing: CPU gloo says nothing about NVLink.

    python bench/tp_comm.py [--tp 2 4] [--layers 4] [--batch 8] [--dtype float32]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
               "all_gather_object", "broadcast", "reduce_scatter_tensor", "all_to_all_single",
               "barrier")
CHECK = "all_reduce (check)"


def random_llama(layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, num_hidden_layers=layers, max_position_embeddings=512,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return AutoModelForCausalLM.from_config(config).eval()


class Counting:
    """Counts calls and bytes (the input tensor's; an all-gather's output is size x that) of
    every torch.distributed collective while active. An all-reduce other than a sum counts as
    CHECK: the engine's consistency checks (rollout/parallel/collectives.py check_same, agree.py)
    reduce with MAX or MIN, the forward only sums."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self.active = False
        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            if self.active:
                tensor = args[1] if name in ("all_gather_single", "all_gather_into_tensor") \
                    else (args[0] if args and isinstance(args[0], torch.Tensor) else None)
                key = name
                if name == "all_reduce":
                    op = kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM)
                    key = name if op == dist.ReduceOp.SUM else CHECK
                self.calls[key] += 1
                self.bytes[key] += 0 if tensor is None else tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)
        return counted


def _rank(rank: int, tp: int, port: int, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp)
    counting = Counting()
    engine = Engine(random_llama(args.layers), EngineConfig(
        tensor_parallel_size=tp, kv_cache_tokens=4096, max_model_len=256, dtype=args.dtype,
        seed=0))
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.batch):
        engine.add_request(torch.randint(SHAPE["vocab_size"], (32,), generator=gen).tolist(),
                           SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True))
    engine.step()  # the prefill of every prompt (and each one's first token)
    steps = 3
    counting.active = True
    for _ in range(steps):
        engine.step()
    counting.active = False
    if rank == 0:
        gather_names = ("all_gather_single", "all_gather_into_tensor")
        expected = 2 * args.layers + 1
        reduces = counting.calls["all_reduce"] / steps
        reduce_kib = counting.bytes["all_reduce"] / steps / 1024
        gathers = sum(counting.calls[n] for n in gather_names) / steps
        gather_kib = sum(counting.bytes[n] for n in gather_names) / steps / 1024
        received_kib = args.batch * SHAPE["vocab_size"] * engine.model.dtype.itemsize / 1024
        checks = counting.calls[CHECK] / steps
        others = {n: c / steps for n, c in counting.calls.items()
                  if n not in ("all_reduce", CHECK) and n not in gather_names}
        ok = reduces == expected and checks == 1 and gathers == 1 and not others
        print(f"tp={tp} layers={args.layers} batch={args.batch} dtype={args.dtype}: per decode "
              f"step {reduces:g} all-reduces ({reduce_kib:.1f} KiB per rank; expected 2 x "
              f"{args.layers} layers + 1 embedding = {expected}) + {checks:g} same-batch check "
              f"({counting.bytes[CHECK] / steps:g} B, expected 1), {gathers:g} logits all-gather "
              f"({gather_kib:.1f} KiB sent, {received_kib:.0f} KiB received per rank), other "
              f"collectives {others or 'none'}: {'OK' if ok else 'UNEXPECTED'}", flush=True)
    _update_from_dtensors(rank, tp, args, counting)
    dist.barrier()
    dist.destroy_process_group()


def _update_from_dtensors(rank: int, tp: int, args, counting: Counting) -> None:
    """update_weights from the same model sharded Shard(0) over the world (FSDP2-like):
    collectives and bytes each rank receives (the all_to_all's output: its own ranges are
    read in place), against gathering every weight whole (one collective per weight,
    (tp - 1) / tp of the model received)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    engine = Engine(random_llama(args.layers), EngineConfig(
        tensor_parallel_size=tp, kv_cache_tokens=256, max_model_len=256, dtype=args.dtype))
    source = random_llama(args.layers)
    mesh = init_device_mesh("cpu", (tp,))
    with torch.no_grad():
        for name, p in list(source.named_parameters()):
            module, attr = name.rsplit(".", 1)
            setattr(source.get_submodule(module), attr,
                    torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    source.lm_head.weight = source.model.embed_tokens.weight  # tied, as before the swap
    weights = len(list(source.parameters()))
    counting.calls.clear()
    counting.bytes.clear()
    counting.active = True
    result = engine.update_weights(source)
    counting.active = False
    model_bytes = sum(p.numel() for p in source.parameters()) * engine.model.dtype.itemsize
    if rank == 0:
        print(f"tp={tp} update_weights from Shard(0) DTensors ({weights} weights, "
              f"{model_bytes / 2**20:.1f} MiB): {sum(counting.calls.values())} collectives "
              f"({dict(counting.calls)}), {counting.bytes['all_to_all_single'] / 1024:.1f} KiB "
              f"received per rank (engine says {result['exchanged_bytes'] / 1024:.1f}); whole-"
              f"weight gathers: {weights} collectives, "
              f"{model_bytes * (tp - 1) / tp / 1024:.1f} KiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    random_llama(1)  # transformers' Llama imported once, before the fork
    for tp in args.tp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [mp.get_context("fork").Process(target=_rank, args=(r, tp, port, args))
                 for r in range(tp)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            sys.exit(f"tp={tp}: a rank failed")


if __name__ == "__main__":
    main()
