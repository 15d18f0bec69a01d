"""The project's layout, read from its source: `ddp` below `stages` below `profiling`; no
module that imports one which imports it back, by any path (every import counts: at the
top, inside a function, or under `TYPE_CHECKING`, since each is a dependency a reader
must hold in mind); and no file in `profiling/` longer than a reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("ddp", "stages", "profiling")  # each may import only the ones before it


def modules() -> dict[str, Path]:
    out = {}
    for top in LAYERS:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (a name inside a module: that module)."""
    known = modules()

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package up
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                deps |= {owner(f"{base}.{a.name}") or owner(base) for a in node.names}
        graph[name] = deps - {None, name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_each_layer_imports_only_the_layers_below_it():
    wrong = [
        f"{module} imports {dep}"
        for module, deps in import_graph().items()
        for dep in deps
        if LAYERS.index(dep.split(".")[0]) > LAYERS.index(module.split(".")[0])
    ]
    assert wrong == []


def test_no_file_in_profiling_is_over_500_lines():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in (ROOT / "profiling").rglob("*.py")}  # fmt: skip
    assert {path: n for path, n in lines.items() if n > 500} == {}


def test_a_cycle_is_found_by_hand():
    # a -> b -> c -> a is one cycle; d only points into it.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
