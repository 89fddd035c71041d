"""Launch K CPU ranks (gloo) that run tests/support/tp_scenarios.py on an engine of
tensor_parallel_size K and write OUT_DIR/rank<i>.json:

    python tests/support/tp_launch.py OUT_DIR K

With K >= 4 the world also runs engines of 2 ranks side by side (data parallel x tensor
parallel, "dp/greedy"). The heavy imports (torch, transformers' model files) happen once here,
then the ranks are forked (tests/support/fork_ranks.py)."""

import json
import os
import sys

sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
# The LoRA scenario's PEFT (1.5 s to import), once here rather than on every forked rank.
import peft  # noqa: E402,F401
import tp_scenarios  # noqa: E402
from fork_ranks import fork_ranks  # noqa: E402


def _rank(rank: int, tp: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp)
    results = tp_scenarios.run_all(tp)
    results.update(tp_scenarios.dtensor_update(
        dict(tp_scenarios.CONFIG, tensor_parallel_size=tp)))
    results.update(tp_scenarios.mismatched_requests(
        dict(tp_scenarios.CONFIG, tensor_parallel_size=tp, check_tensor_parallel=False)))
    results.update(tp_scenarios.failed_on_one_rank(
        dict(tp_scenarios.CONFIG, tensor_parallel_size=tp)))
    if tp >= 4:
        results["dp/greedy"] = tp_scenarios.data_parallel(tp_scenarios.CONFIG, 2)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    # Explicit teardown: left to interpreter exit, gloo can abort a rank after success.
    dist.barrier()
    dist.destroy_process_group()


def main(out_dir: str, tp: int, timeout: float = 300) -> int:
    torch.set_num_threads(1)
    for build in tp_scenarios.MODELS.values():
        build(0)  # imports each family's transformers modules before the fork
    return fork_ranks(_rank, tp, (out_dir,), timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
