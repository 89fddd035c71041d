"""Code and docs cite only files the repository has: every repository path named in a source
file, a doc page or the README (`rollout/kv/pool.py`, `docs/architecture.md`, ...) exists."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).parents[2]
TOPS = ("rollout", "kernels", "trainer_hooks", "recipes", "tests", "bench", "docs")
CITED = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOPS)})/[\w./-]*\w\.(?:py|c|h|md|sh|yaml))\b")
# Files a run writes (not in the repository): the demo's outputs and the like.
WRITTEN = re.compile(r"^(outputs|runs)/")


def sources() -> list[pathlib.Path]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in listed
            if re.search(r"\.(py|c|h|sh|md|yaml)$|^Makefile$", f) and (ROOT / f).is_file()]


def test_every_cited_path_exists():
    missing = {}
    for path in sources():
        for cited in CITED.findall(path.read_text(errors="replace")):
            if not WRITTEN.match(cited) and not (ROOT / cited).exists():
                missing.setdefault(cited, path.relative_to(ROOT).as_posix())
    assert missing == {}


def test_the_checker_finds_a_citation():
    assert CITED.findall("see rollout/kv/pool.py and docs/architecture.md.") == [
        "rollout/kv/pool.py", "docs/architecture.md"]
