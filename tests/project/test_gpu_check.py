"""bench/gpu_check.sh runs in a short GPU session that nothing else checks beforehand: a test file
that runs compiled on a GPU (it imports kernels_env, whose DEVICE is CUDA there) but is missing
from the script's lists is never run on one, and a path the lists name that no longer exists
costs the session its run."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")


def read(name: str) -> str:
    with open(os.path.join(ROOT, "bench", name)) as f:
        return f.read()


def named_files(text: str) -> set[str]:
    """The test files `text` names, braces and globs expanded as bash expands them."""
    words = re.findall(r"tests/[\w/{},.*]+\.py", text)
    expanded = subprocess.run(["bash", "-c", "echo " + " ".join(words)], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.split()
    return set(expanded)


def gpu_test_files(folder: str = "") -> set[str]:
    found = set()
    for dirpath, _, files in os.walk(os.path.join(TESTS, folder)):
        for name in files:
            path = os.path.join(dirpath, name)
            if name.startswith("test_") and name.endswith(".py"):
                with open(path) as f:
                    if re.search(r"^from kernels_env import", f.read(), re.M):
                        found.add(os.path.relpath(path, ROOT))
    return found


def section(text: str, start: str, end: str) -> str:
    return text[text.index(start):text.index(end, text.index(start))]


def test_owed_runs_every_test_that_runs_on_a_gpu():
    owed = named_files(section(read("gpu_check.sh"), 'if [ "$what" = owed ]', "\nfi\n"))
    assert gpu_test_files() - owed == set()
    assert {p for p in owed if not os.path.isfile(os.path.join(ROOT, p))} == set()


def test_correctness_runs_every_triton_kernel_test():
    # gpu_check_kernels.sh's processes, and the fused MoE kernel's beside them in gpu_check.sh
    moe = section(read("gpu_check.sh"), "moe_kernel_tests() {", "\n}\n")
    correctness = named_files(read("gpu_check_kernels.sh") + moe)
    assert gpu_test_files("kernels") - correctness == set()
    assert {p for p in correctness if not os.path.isfile(os.path.join(ROOT, p))} == set()
