"""One decode step of a GRPO rollout on the CPU: the cpu backend's attention kernel against the
torch backend's shared-prefix and plain gather paths, and against the step's matmul time.

Workload (issue 11): a random-weight Llama of SmolLM2-135M's shapes (hidden 576, 30 layers,
9 heads, 3 KV heads, head_dim 64, vocab 49152), 16 prompts sharing a 282-token system prompt,
n = 8, so 128 samples decode side by side once the prompts are cached. The engine runs until
every sample has generated --decoded tokens (several points, one run); that step's inputs are
then replayed:

- step: the step's attention plan + model forward (+ logits of the 128 sampled rows) on three
  paths: "native" (the C kernel of rollout_kernels.cpu reading the pool in place, the cpu
  backend's),
  "shared" (the torch shared-prefix split) and "plain" (torch gathers: the same metadata without
  shared_lens, which is what the backend does for groups that share nothing);
- matmul: the same step's linear layers alone (QKV, O, gate-up, down of every layer and the
  LM head on a [128, hidden] input), the floor the issue measures against; through the
  engine's own projections, so on packed weights unless --no-pack; its GFLOP/s as a share of
  the CPU's FMA peak, measured in the same loop (fma_peak.c, the widest FMAs the CPU has);
  `ROLLOUT_NATIVE_MARCH=x86-64-v3` runs the AVX2 kernels on an AVX-512 host to compare;
- engine: whole engine steps (schedule, prepare, forward, sample, commit), alternating paths;
  with --top-p, also native steps whose samples all filter by that top_p (the issue's "a
  top-p=0.9 step against a step without it").

Best of --repeat, paths and matmul interleaved (each in turn first after the FMA probe). At
--profile-at, the torch profiler's top ops of one step each way. Nothing is asserted but that
both paths' logits agree (printed).

    python bench/decode_step.py [--threads 2] [--decoded 8 64 192] [--repeat 10] [--no-pack]
                                [--top-p 0.9] [--real]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fma_peak import FmaPeak, rotated  # noqa: E402
from workloads import SMOLLM2_135M, cpu_name, random_llama  # noqa: E402

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.attention.cpu import CpuAttention  # noqa: E402
from rollout.attention.sdpa import TorchAttention  # noqa: E402


def prompts_sharing(num_prompts: int, prefix_len: int, prompt_len: int, vocab: int, seed=0):
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(vocab, (prefix_len,), generator=gen).tolist()
    return [system + torch.randint(vocab, (prompt_len - prefix_len,), generator=gen).tolist()
            for _ in range(num_prompts)]


class PathSwitch:
    """The bench's switch of the runner's attention (the product has none): "native" the
    engine's own (the cpu backend's kernel), "shared" the torch backend over the same pool,
    "plain" the torch backend with the step's shared lengths dropped, so every request takes
    the plain gather path."""

    def __init__(self, runner) -> None:
        self.runner, self.native = runner, runner.attention
        self.torch = TorchAttention(self.native.pool, self.native.windows)
        self.has_native = isinstance(self.native, CpuAttention)
        torch_plan = self.torch.plan

        def plan(meta):
            if self.mode == "plain":
                meta.groups, meta.shared_lens = [], []
            return torch_plan(meta)

        self.torch.plan = plan
        self.mode = self.modes()[0]

    def modes(self) -> tuple[str, ...]:
        return ("native", "shared", "plain") if self.has_native else ("shared", "plain")

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self._mode = mode
        self.runner.attention = self.native if mode == "native" else self.torch


def start(engine: Engine, prompts, n: int) -> None:
    params = SamplingParams(n=n, temperature=1.0, max_tokens=10**6, ignore_eos=True, seed=0)
    for p in prompts:
        engine.add_request(p, params)


def capture_decode_step(engine: Engine, num_samples: int, decoded: int):
    """Steps the engine until every sample has `decoded` tokens; returns the inputs of the last
    decode step (the engine is left mid-generation, its K/V in place)."""
    runner, captured = engine.runner, {}
    prepare = runner.prepare

    def recording(batch):
        captured["inputs"] = inputs = prepare(batch)
        return inputs

    runner.prepare = recording
    try:
        while True:
            engine.step()
            running = engine.scheduler.running
            if (len(running) == num_samples
                    and min(len(s.token_ids) - s.num_prompt for s in running) >= decoded):
                return captured["inputs"]
    finally:
        runner.prepare = prepare


def replay(runner, inputs, switch: PathSwitch, mode: str) -> float:
    """Seconds of plan + forward of the captured step on path `mode`; the step rewrites the
    same K/V into the same slots, so replays change nothing."""
    switch.mode = mode
    meta = dataclasses.replace(inputs.meta, plan=None, groups=list(inputs.meta.groups),
                               shared_lens=list(inputs.meta.shared_lens))
    t0 = time.perf_counter()
    meta.plan = runner.attention.plan(meta)
    runner.run(dataclasses.replace(inputs, meta=meta))
    return time.perf_counter() - t0


@torch.inference_mode()
def matmul_seconds(model, batch: int) -> float:
    """The step's linear layers alone on a [batch, hidden] input."""
    dtype = model.dtype
    attn0, mlp0 = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = torch.randn(batch, model.config.hidden_size, dtype=dtype)
    x_attn = torch.randn(batch, attn0.q_size, dtype=dtype)
    x_mlp = torch.randn(batch, mlp0.intermediate, dtype=dtype)
    t0 = time.perf_counter()
    for layer in model.model.layers:
        layer.self_attn.qkv_proj(x)
        layer.self_attn.o_proj(x_attn)
        layer.mlp.gate_up_proj(x)
        layer.mlp.down_proj(x_mlp)
    model.compute_logits(x)
    return time.perf_counter() - t0


def matmul_flops(model, batch: int) -> float:
    """What matmul_seconds computes: 2 FLOPs per weight per row."""
    weights = sum(proj.weight.numel() for layer in model.model.layers
                  for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                               layer.mlp.gate_up_proj, layer.mlp.down_proj))
    return 2.0 * batch * (weights + model.head.weight.numel())


def engine_steps(engine: Engine, switch: PathSwitch, steps: int,
                 top_p: float | None) -> dict[str, list[float]]:
    """Whole steps, the paths alternating; with `top_p`, native steps alternate with native
    steps whose every sample filters by top_p (the bench's switch: the running samples'
    params are swapped between steps)."""
    modes = (*switch.modes(), *(("native+top_p",) if top_p is not None else ()))
    times = {mode: [] for mode in modes}
    for i in range(len(modes) * steps):
        mode = modes[i % len(modes)]
        switch.mode = mode.split("+")[0]
        for seq in engine.scheduler.running:
            seq.params = dataclasses.replace(seq.params,
                                             top_p=top_p if mode.endswith("top_p") else 1.0)
        t0 = time.perf_counter()
        engine.step()
        times[mode].append(time.perf_counter() - t0)
    switch.mode = switch.modes()[0]
    return times


def profile(runner, inputs, switch, mode: str, rows: int) -> str:
    replay(runner, inputs, switch, mode)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        replay(runner, inputs, switch, mode)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows,
                                     max_name_column_width=48)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=282, help="shared system prompt")
    ap.add_argument("--prompt-len", type=int, default=314, help="system prompt + own question")
    ap.add_argument("--decoded", type=int, nargs="+", default=[8, 64, 192],
                    help="measure the step at which every sample has this many tokens")
    ap.add_argument("--profile-at", type=int, default=64, help="profile at this --decoded")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--engine-steps", type=int, default=5, help="per path; 0 skips")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (smoke runs)")
    ap.add_argument("--profile-rows", type=int, default=12)
    ap.add_argument("--real", action="store_true",
                    help="the SmolLM2-135M-Instruct checkpoint and chat prompts (bench/peers.py's "
                         "system prompt and questions) instead of random weights and tokens")
    ap.add_argument("--top-p", type=float, default=None,
                    help="also time whole steps with every sample at this top_p")
    ap.add_argument("--no-pack", action="store_true",
                    help="EngineConfig(pack_cpu_weights=False): plain F.linear projections")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    probe = FmaPeak()

    if args.real:  # the checkpoint, chat prompts sharing the peers' system prompt
        from peers import SYSTEM, questions, render

        from rollout_recipes.run import smollm2

        model, tok = smollm2.load()
        prompts = [render(tok, [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": q}])
                   for q in questions(args.prompts, seed=0)]
    else:
        layers = args.layers or SMOLLM2_135M["num_hidden_layers"]
        model = random_llama(dict(SMOLLM2_135M, num_hidden_layers=layers))
        prompts = prompts_sharing(args.prompts, args.prefix_len, args.prompt_len,
                                  model.config.vocab_size)
    engine = Engine(model, EngineConfig(kv_cache_tokens=65536, max_model_len=1024,
                                        max_num_seqs=max(256, args.prompts * args.n),
                                        pack_cpu_weights=not args.no_pack,
                                        keep_cpu_heap=True))
    runner = engine.runner
    switch = PathSwitch(runner)
    num_samples = args.prompts * args.n
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{model.config.num_hidden_layers} layers{' (SmolLM2-135M-Instruct)' * args.real}; "
          f"{args.prompts} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} "
          f"tokens, n = {args.n}")
    start(engine, prompts, args.n)
    for decoded in sorted(args.decoded):
        # the engine's own path between measurements: the "plain" path's plan would empty the
        # captured step's shared lengths
        switch.mode = switch.modes()[0]
        inputs = capture_decode_step(engine, num_samples, decoded)
        measure(engine, inputs, switch, args, probe, profile_it=decoded == args.profile_at)


def measure(engine, inputs, switch, args, probe: FmaPeak, profile_it: bool) -> None:
    runner, meta = engine.runner, inputs.meta
    batch = len(meta.q_lens)
    assert max(meta.q_lens) == 1 and batch == args.prompts * args.n
    suffix = [kv - s for kv, s in zip(meta.kv_lens, meta.shared_lens)]
    print(f"\n=== decode step of {batch} samples: kv_len {min(meta.kv_lens)}..{max(meta.kv_lens)}"
          f", private suffix {min(suffix)}..{max(suffix)} (new token included), shared prefix "
          f"{min(meta.shared_lens)}..{max(meta.shared_lens)} in {len(set(meta.groups))} groups")
    # Both paths give the same logits.
    logits = {}
    for mode in switch.modes():
        switch.mode = mode
        m = dataclasses.replace(meta, plan=None, groups=list(meta.groups),
                                shared_lens=list(meta.shared_lens))
        m.plan = runner.attention.plan(m)
        logits[mode] = runner.run(dataclasses.replace(inputs, meta=m))[0]
    diff = max((logits[mode] - logits["plain"]).abs().max().item() for mode in logits)
    print(f"max |logits - plain path's| = {diff:.2e}")

    best = {mode: float("inf") for mode in (*switch.modes(), "matmul")}
    peak = 0.0
    for i in range(args.repeat):
        for case in rotated(list(best), i):
            seconds = (matmul_seconds(runner.model, batch) if case == "matmul"
                       else replay(runner, inputs, switch, case))
            best[case] = min(best[case], seconds)
        peak = max(peak, probe.gflops(torch.get_num_threads()))
    mm = best["matmul"]
    rate = matmul_flops(runner.model, batch) / mm / 1e9
    print(f"best of {args.repeat}, interleaved (plan + forward + logits of the step):")
    print(f"  matmul only        {mm * 1e3:8.1f} ms   = {rate:.1f} GFLOP/s, {rate / peak:.0%} of "
          f"the FMA peak ({peak:.1f} GFLOP/s on {torch.get_num_threads()} threads, "
          f"{probe.lanes}-lane FMAs; {cpu_name()}) [{runner.model.dtype}]")
    for mode in switch.modes():
        print(f"  step, {mode:6} path {best[mode] * 1e3:8.1f} ms   "
              f"= {best[mode] / mm:.2f}x matmul")

    if args.engine_steps:
        times = engine_steps(engine, switch, args.engine_steps, args.top_p)
        print(f"whole engine steps (schedule..commit, sampling included), best of "
              f"{args.engine_steps} each, alternating:")
        for mode in times:
            extra = (f", {min(times[mode]) / min(times['native']):.3f}x the native step"
                     if mode.endswith("top_p") else "")
            print(f"  {mode:12} {min(times[mode]) * 1e3:8.1f} ms   "
                  f"= {min(times[mode]) / mm:.2f}x matmul{extra}")

    if profile_it:
        for mode in switch.modes():
            print(f"\ntorch profiler, one decode step, {mode} path (top ops by self CPU time):")
            print(profile(runner, inputs, switch, mode, args.profile_rows))


if __name__ == "__main__":
    main()
