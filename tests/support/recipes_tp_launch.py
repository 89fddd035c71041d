"""Run a recipe on W CPU ranks (gloo) as `accelerate launch --num_processes W` would, and write
what each rank's engine was asked and answered to OUT_DIR/rank<i>.json:

    python tests/support/recipes_tp_launch.py OUT_DIR W --config X.yaml [--key value ...]

Each rank records every ColocatedRollout.generate call (the engine's requests and samples) and,
for `--trainer trl`, every rollout_func call (the rows TRL gave the rank and the completions it
got back). The heavy imports happen once here, then the ranks are forked with the environment
torchrun would give them (RANK, WORLD_SIZE, ...): on a 2-core CI machine W fresh interpreters
importing torch, transformers and TRL would take longer than the run. A rank that fails makes
the others stop (they would wait on it forever)."""

import json
import os
import sys

sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

from fork_ranks import fork_ranks  # noqa: E402
from rollout_recipes.grpo import main as recipe  # noqa: E402
from trainer_hooks.colocate import ColocatedRollout  # noqa: E402
from trainer_hooks.trl_rollout import EngineRollout  # noqa: E402


def _record(calls: dict) -> None:
    generate, rollout_func = ColocatedRollout.generate, EngineRollout.__call__

    def engine_call(self, prompts, params=None, **kwargs):
        outs = generate(self, prompts, params, **kwargs)
        calls["tp"] = [self.engine.tp.rank, self.engine.tp.size]
        calls["engine"].append({"prompts": [list(p) for p in prompts],
                                "samples": [[list(s.token_ids) for s in o.samples]
                                            for o in outs]})
        return outs

    def trl_call(self, prompts, trainer):
        out = rollout_func(self, prompts, trainer)
        calls["trl"].append({"prompts": out["prompt_ids"], "completions": out["completion_ids"]})
        return out

    ColocatedRollout.generate, EngineRollout.__call__ = engine_call, trl_call


def _rank(rank: int, world: int, port: int, out_dir: str, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    calls: dict = {"engine": [], "trl": [], "tp": None}
    _record(calls)
    result = recipe(argv)
    report = {"calls": calls, "history": result["history"],
              "engine_stats": result.get("engine_stats"),
              "accuracy": [result.get("accuracy_before"), result.get("accuracy_after")]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def main(out_dir: str, world: int, argv: list[str], timeout: float = 240) -> int:
    return fork_ranks(_rank, world, (out_dir, argv), timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3:]))
