import os
import sys

# The suite mirrors the packages (tests/engine/ for rollout/engine/, ...). Tests import the shared
# helpers of tests/support/ (tiny models, tokenizers, references) and, for a few shared cases,
# each other's modules by plain name: every folder of the suite is on the path, support first.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "support"), *sorted(
    os.path.join(HERE, d) for d in os.listdir(HERE)
    if d != "support" and os.path.isdir(os.path.join(HERE, d)) and not d.startswith(("_", ".")))]
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402

# Without a GPU the suite runs the Triton kernels (and the engine's triton backend) in Triton's
# interpreter: set before anything imports triton, as any process that wants it must (the
# engine never sets it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny models: one thread avoids oversubscription on the 2-core CI machine (several times
# faster per step under load than the default).
torch.set_num_threads(1)

# The longest files first (durations of a 2-core run, AMD EPYC Zen 3, 2026-12-08: 211 s down
# to 34 s): `make test` gives each xdist worker whole files (--dist loadfile), so a long file
# handed out late leaves the other worker idle at the end; started first, the short files fill
# in around them (longest-first scheduling). A file missing here or grown since only costs
# balance, never a test.
LONGEST_FIRST = ("test_learning.py", "test_batch_invariant.py", "test_lifecycle_machine.py",
                 "test_faults.py", "test_cpu_build.py", "test_real_model.py",
                 "test_tensor_parallel.py", "test_cuda_graph.py", "test_cpu_heap.py",
                 "test_bench_smoke.py", "test_routes_carried.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept within
