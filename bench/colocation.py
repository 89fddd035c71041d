"""Colocation costs on a Qwen2.5-0.5B-shaped model with random weights.

Prints sleep (level 1 and 2) and wake times, the engine's memory held awake / asleep, and the
weight sync (update_weights from a separate HF model instance, as a trainer would) in seconds and
GB/s, and what the copies' checksums cost of a sync. On CUDA also torch.cuda.memory_allocated before the engine exists and after sleep(2): the
two should match (everything the engine allocated is given back). Nothing is asserted.

    python bench/colocation.py                        # CPU, bfloat16 (~1 GB per model copy)
    python bench/colocation.py --device cuda          # GPU, bfloat16
    python bench/colocation.py --device cuda --source cpu   # sync from host memory instead
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workloads import QWEN2_05B, random_qwen2  # noqa: E402

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.colocation import checksum  # noqa: E402
from rollout.colocation.device_memory import tensor_bytes  # noqa: E402

GB = 1e9


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def allocated(device: torch.device) -> str:
    return f"{torch.cuda.memory_allocated(device) / GB:.3f} GB" if device.type == "cuda" else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV pool size (default 16384 on CPU, 131072 on CUDA)")
    p.add_argument("--source", default="device", choices=["device", "cpu"],
                   help="where the trainer's copy of the weights lives for update_weights")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    kv_tokens = args.kv_tokens or (131072 if device.type == "cuda" else 16384)
    torch.set_num_threads(os.cpu_count() or 1)

    t0 = time.perf_counter()
    policy = random_qwen2(QWEN2_05B, dtype, device, seed=0)  # the model the engine starts from
    trainer = random_qwen2(QWEN2_05B, dtype, "cpu" if args.source == "cpu" else device, seed=1)
    build = time.perf_counter() - t0
    params = sum(p.numel() for p in policy.parameters())
    print(f"model: Qwen2 0.5B shape, {params / 1e6:.0f}M params, {args.dtype}, {device}; "
          f"two HF copies built in {build:.1f}s; KV pool {kv_tokens} tokens; "
          f"sync source on {args.source}")
    before_engine = allocated(device)
    engine = Engine(policy, EngineConfig(kv_cache_tokens=kv_tokens, max_model_len=1024,
                                         max_num_seqs=64, device=device))
    # `policy` stays alive: memory_allocated after sleep(2) must come back to `before_engine`.
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, seed=0))  # touch the pool
    awake = engine.memory_held()
    weights = tensor_bytes([*engine.model.parameters(), *engine.model.buffers()])
    packed, kv = engine.model.derived_bytes(), engine.inspect().kv_bytes
    print(f"engine memory held awake: {awake / GB:.3f} GB (weights {weights / GB:.3f} GB + "
          f"their packed copies {packed / GB:.3f} GB + KV pool {kv / GB:.3f} GB + slot table "
          f"and per-slot extras {(awake - weights - packed - kv) / GB:.3f} GB)")
    print(f"cuda memory_allocated before engine creation: {before_engine}, "
          f"engine awake: {allocated(device)}")

    rows = []
    for _ in range(args.repeats):
        s1 = timed(lambda: engine.sleep(1), device)
        held1, alloc1 = engine.memory_held(), allocated(device)
        w1 = timed(engine.wake_up, device)
        s2 = timed(lambda: engine.sleep(2), device)
        held2, alloc2 = engine.memory_held(), allocated(device)
        w2 = timed(engine.wake_up, device)
        sync = engine.update_weights(trainer)  # refills what level 2 dropped
        awake_sync = engine.update_weights(trainer)  # in place while awake
        rows.append((s1, held1, alloc1, w1, s2, held2, alloc2, w2, sync, awake_sync))

    print(f"\n{'':>24}" + "".join(f"{f'run {i}':>14}" for i in range(len(rows))))
    lines = [
        ("sleep(1) s", lambda r: f"{r[0]:.4f}"),
        ("  held after, GB", lambda r: f"{r[1] / GB:.3f}"),
        ("  cuda allocated", lambda r: r[2]),
        ("wake from 1 s", lambda r: f"{r[3]:.4f}"),
        ("sleep(2) s", lambda r: f"{r[4]:.4f}"),
        ("  held after, GB", lambda r: f"{r[5] / GB:.3f}"),
        ("  cuda allocated", lambda r: r[6]),
        ("wake from 2 s", lambda r: f"{r[7]:.4f}"),
        ("sync after sleep(2) s", lambda r: f"{r[8]['seconds']:.4f}"),
        ("  GB/s", lambda r: f"{r[8]['bytes'] / r[8]['seconds'] / GB:.2f}"),
        ("sync while awake s", lambda r: f"{r[9]['seconds']:.4f}"),
        ("  GB/s", lambda r: f"{r[9]['bytes'] / r[9]['seconds'] / GB:.2f}"),
    ]
    for name, cell in lines:
        print(f"{name:>24}" + "".join(f"{cell(r):>14}" for r in rows))
    print(f"\nweights moved per sync: {rows[0][8]['bytes'] / GB:.3f} GB; "
          f"cuda memory_allocated before engine creation {before_engine}, "
          f"after sleep(2) {rows[-1][6]}")
    # The copies' checksums (rollout/colocation/checksum.py) against the same syncs without
    # them, interleaved, best of --repeats each.
    # On the CPU "checked" is the C checked copy where it applies; "torch checks" the torch
    # passes it replaces (checksum.bit_sum twice, aminmax).
    checked, torch_checked, unchecked = [], [], []
    kept = (checksum.Checked.copy, checksum.Checked.verify, checksum.native_copy.supported)
    for _ in range(args.repeats):
        checked.append(engine.update_weights(trainer)["seconds"])
        checksum.native_copy.supported = lambda dst, src: False
        try:
            torch_checked.append(engine.update_weights(trainer)["seconds"])
            checksum.Checked.copy = lambda self, name, dst, src: dst.copy_(src)
            checksum.Checked.verify = lambda self: None
            unchecked.append(engine.update_weights(trainer)["seconds"])
        finally:
            checksum.Checked.copy, checksum.Checked.verify, checksum.native_copy.supported = kept
    base = min(unchecked)
    print(f"sync while awake, best of {args.repeats}: unchecked {base:.4f} s; checked "
          f"{min(checked):.4f} s ({min(checked) / base - 1:+.1%}); with the torch checks "
          f"{min(torch_checked):.4f} s ({min(torch_checked) / base - 1:+.1%})")
    out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, seed=0, logprobs=True))
    print(f"generates after the cycles: {out[0].samples[0].token_ids}")


if __name__ == "__main__":
    main()
