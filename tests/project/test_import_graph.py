"""The module graph of rollout/, kernels/ (imported as rollout_kernels), trainer_hooks/ and
recipes/ (rollout_recipes): no cycles, and every import goes down the declared layer order
(imports inside functions count: a lazy import still ties the two modules together; imports
under `if TYPE_CHECKING:` do not run, so they do not). The kernels are a leaf the engine calls
into; integrations sit on top."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parents[2]
PACKAGES = {"rollout": "rollout", "kernels": "rollout_kernels", "trainer_hooks": "trainer_hooks",
            "recipes": "rollout_recipes"}  # folder -> import name

# Bottom to top: a module may import its own layer's modules and those of layers below it. A
# name stands for the module and everything under it; the longest name that matches decides
# (rollout.spec.config lies below rollout.config, the rest of rollout.spec far above).
LAYERS = [
    ["rollout_kernels"],  # Triton and C kernels, torch references: nothing of rollout
    ["rollout.fields"],  # field checks of every public input
    ["rollout.ops"],  # backends and the dispatch of ops to their implementations
    ["rollout.config", "rollout.spec.config"],
    ["rollout.journal"],  # the undo log of a step's bookkeeping
    ["rollout.parallel"],
    ["rollout.colocation"],  # parking, weight sources, device and host memory
    ["rollout.kv"],
    # the logprobs' log_softmax and the alternatives' order: the sampler's and scoring's
    ["rollout.sample.log_softmax", "rollout.sample.ranked"],
    ["rollout.score"],  # a scored sequence's rows and the call's rounds (not its arguments)
    ["rollout.sample"],
    ["rollout.attention"],
    ["rollout.models"],
    ["rollout.lora"],  # a PEFT adapter served unmerged on the models' projections
    ["rollout.requests", "rollout.score.intake"],
    ["rollout.executor"],
    ["rollout.spec"],
    ["rollout.engine"],
    ["rollout", "rollout.api", "rollout.agent"],  # the package face
    ["trainer_hooks"],
    ["rollout_recipes"],
]


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGES[parts[0]], *parts[1:]])


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Modules of `known` that `name` imports, anywhere but under `if TYPE_CHECKING:`."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(target: str) -> None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target:
            found.add(target)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")
                parent = parent[:len(parent) - node.level + (1 if is_package else 0)]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                resolve(full if full in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def layer_of(module: str) -> int:
    best, found = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), i
    assert found is not None, f"{module} is in no layer of LAYERS"
    return found


def upward_imports(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, bs in edges.items() for b in bs if layer_of(b) > layer_of(a)}


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_every_import_goes_down_the_layers():
    assert upward_imports(graph()) == set()


def test_kernels_import_nothing_from_rollout():
    edges = graph()
    assert {(a, b) for a, bs in edges.items() if a.startswith("rollout_kernels")
            for b in bs if b.split(".")[0] == "rollout"} == set()


def test_the_checker_sees_lazy_imports_and_wrong_way_ones():
    edges = graph()
    assert "rollout.attention.triton" in edges["rollout.attention.registry"]  # in a function
    assert "rollout.attention.base" in edges["rollout.attention.triton"]
    assert "rollout.executor.cuda_graph" not in edges["rollout.executor.runner"]  # TYPE_CHECKING
    assert "rollout.requests.sequence" not in edges["rollout.kv.manager"]  # TYPE_CHECKING
    # A kv module importing the engine would go up five layers: the test would see it.
    assert upward_imports({"rollout.kv.manager": {"rollout.engine.engine"}}) == {
        ("rollout.kv.manager", "rollout.engine.engine")}
    assert layer_of("rollout.spec.config") == layer_of("rollout.config") < layer_of("rollout.spec")
