"""The module graph of rollout/ and kernels/ (imported as rollout_kernels) has no cycles (imports inside functions count: a
lazy import still ties the two modules together), and kernels/ imports nothing from rollout/:
the kernels are a leaf the engine calls into."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent
PACKAGES = {"rollout": "rollout", "kernels": "rollout_kernels"}  # folder -> import name


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


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_kernels_import_nothing_from_rollout():
    edges = graph()
    assert {(a, b) for a, bs in edges.items() if a.startswith("rollout_kernels")
            for b in bs if b.split(".")[0] == "rollout"} == set()


def test_the_checker_sees_lazy_imports():
    edges = graph()
    assert "rollout.triton_attention" in edges["rollout.backends"]  # imported in a function
    assert "rollout.attention" in edges["rollout.triton_attention"]
    assert "rollout.cuda_graph" not in edges["rollout.model_runner"]  # TYPE_CHECKING only
