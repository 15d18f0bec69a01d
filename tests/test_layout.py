"""The project's layout, read from its source: `ddp` below `stages` below `profiling`, and
inside `profiling` its groups in order (what every group uses, the tools, the simulator,
the course and the studies), the simulator's core importing neither its checks nor
`stages`; no module that imports one which imports it back, by any path (every import
counts: at the top, inside a function, or under `TYPE_CHECKING`, since each is a
dependency a reader must hold in mind); `ddp` holds only what more than one stage, the
harness or `profiling` uses, and reads no stage's private attributes; imports at the top
of modules, a local one only with its reason; no two modules of one name unless they play
one role in parallel packages; and no file in `profiling/` longer than a reader takes in
at once."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("ddp", "stages", "profiling")  # each may import only the ones before it

# profiling's groups, lowest first: a module may import its own rank and those below.
PROFILING_RANKS = {
    "profiling.analysis": 0,  # reading traces
    "profiling.common": 0,  # what every group writes and draws with
    "profiling.compare": 1,  # the tools the README runs
    "profiling.bench": 1,
    "profiling.overhead": 1,
    "profiling.cluster": 1,
    "profiling.collectives": 1,
    "profiling.simulate": 2,  # the simulator wing
    "profiling.course": 3,  # the course's figure makers
    "profiling.studies": 3,  # the studies behind the docs
}
# The simulator's checks of its model, and its command line, which names them all.
SIMULATOR_EXTENSIONS = ("profiling.simulate.cpu_cluster", "profiling.simulate.published")
SIMULATOR_ENTRIES = ("profiling.simulate.cli", "profiling.simulate.__main__")
# Names that several packages share because each plays that one role in its package.
SHARED_ROLES = {
    "__init__": "a package",
    "__main__": "a package's `python -m` entry",
    "cli": "a package's command line",
    "output": "what a tool's run prints and writes (bench, collectives)",
    "worker": "what each rank runs under torchrun (collectives, simulate.cpu_cluster)",
}
LOCAL_IMPORTS_MAX = 30  # imports inside functions in profiling/, each with its reason


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


def ddp_modules_of_one_stage(graph: dict[str, set[str]]) -> list[str]:
    """Every module in ddp/ that serves one stage alone: it belongs beside that stage (as
    the drop-in's torch surface sits in `stages/drop_in/`). A module's users are the
    stage packages, profiling and the `stages` harness that import it, directly or
    through other modules in ddp/ (one that only another ddp module imports serves
    whom that one serves)."""

    def users(module: str, seen: frozenset = frozenset()) -> set[str]:
        out = set()
        for user, deps in graph.items():
            if module in deps and user not in seen:
                if user.startswith("ddp."):
                    out |= users(user, seen | {module})
                else:
                    out.add(".".join(user.split(".")[:2]))
        return out

    wrong = []
    for module in sorted(m for m in graph if m.startswith("ddp.")):
        served = users(module)
        if len(served) == 1 and next(iter(served)).startswith("stages."):
            wrong.append(f"{module} serves {next(iter(served))} alone")
    return wrong


def test_every_module_in_ddp_serves_more_than_one_stage():
    assert ddp_modules_of_one_stage(import_graph()) == []


def test_a_module_in_ddp_of_one_stage_is_found():
    # ddp.a and ddp.d (through ddp.a) serve stages.x alone; ddp.b two stages; ddp.c profiling.
    graph = {"ddp.a": {"ddp.d"}, "ddp.b": set(), "ddp.c": set(), "ddp.d": set(),
             "stages.x": {"ddp.a", "ddp.b"}, "stages.x.helper": {"ddp.a"},
             "stages.y": {"ddp.b"}, "profiling.p": {"ddp.c"}}  # fmt: skip
    assert ddp_modules_of_one_stage(graph) == [
        "ddp.a serves stages.x alone",
        "ddp.d serves stages.x alone",
    ]


def stage_private_names() -> set[str]:
    """The single-underscore names the classes in stages/ own: each assigned as
    `self._name` (state) or defined as a method."""
    names = set()
    for path in (ROOT / "stages").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                names |= {f.name for f in node.body
                          if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}  # fmt: skip
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reads(source: str, private: set[str]) -> list[tuple[int, str]]:
    """(line, expression) for each access to one of `private` on anything but `self`,
    `cls` or `super()`: another object's private state."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr in private):
            continue
        owner = node.value.func if isinstance(node.value, ast.Call) else node.value
        if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls", "super")):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_ddp_reads_no_stages_private_attributes():
    private = stage_private_names()
    assert {"_awaiting_sync", "_start_backward"} <= private  # state and methods, collected
    reads = [f"{p.relative_to(ROOT)}:{line}: {what}"
             for p in sorted((ROOT / "ddp").rglob("*.py"))
             for line, what in private_reads(p.read_text(), private)]  # fmt: skip
    assert reads == [], "ddp/ reads a stage's private state: move that code beside the stage"


def test_a_read_of_a_stages_private_attribute_is_found():
    source = (
        "class Stage:\n"
        "    def f(self, ddp):\n"
        "        self._x = super()._x\n"
        "        return ddp._x, ddp.wrapper()._y, ddp._other, ddp.public\n"
    )
    assert private_reads(source, {"_x", "_y"}) == [(4, "ddp._x"), (4, "ddp.wrapper()._y")]


def group_of(module: str) -> str | None:
    for group in sorted(PROFILING_RANKS, key=len, reverse=True):
        if module == group or module.startswith(group + "."):
            return group
    return None


def profiling_layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Every import in profiling/ that points up its groups, or out of the simulator's core
    into its checks or `stages`."""
    wrong = []
    for module, deps in graph.items():
        if not module.startswith("profiling."):
            continue
        group = group_of(module)
        if group is None:
            wrong.append(f"{module} is in no group of profiling")
            continue
        core = group == "profiling.simulate" and not module.startswith(
            SIMULATOR_EXTENSIONS + SIMULATOR_ENTRIES
        )
        for dep in deps:
            dep_group = group_of(dep)
            if dep_group and PROFILING_RANKS[dep_group] > PROFILING_RANKS[group]:
                wrong.append(f"{module} imports {dep}, a higher group")
            if core and (dep.startswith(SIMULATOR_EXTENSIONS + SIMULATOR_ENTRIES)
                         or dep.split(".")[0] == "stages"):  # fmt: skip
                wrong.append(f"{module} (the simulator's core) imports {dep}")
    return sorted(wrong)


def test_profilings_groups_import_only_their_rank_and_below():
    assert profiling_layer_breaches(import_graph()) == []


def test_a_breach_of_profilings_groups_is_found():
    graph = import_graph()
    before = set(profiling_layer_breaches(graph))
    graph["profiling.bench.records"] = graph["profiling.bench.records"] | {"profiling.course"}
    graph["profiling.simulate.schedule"] = graph["profiling.simulate.schedule"] | {
        "profiling.simulate.published.terms", "stages.drop_in"}  # fmt: skip
    assert sorted(set(profiling_layer_breaches(graph)) - before) == [
        "profiling.bench.records imports profiling.course, a higher group",
        "profiling.simulate.schedule (the simulator's core) imports "
        "profiling.simulate.published.terms",
        "profiling.simulate.schedule (the simulator's core) imports stages.drop_in",
    ]


def test_profilings_top_level_is_its_tools_and_groups_each_with_its_role():
    entries = {p.stem for p in (ROOT / "profiling").iterdir()
               if p.suffix == ".py" or any(p.rglob("*.py"))}  # fmt: skip
    tops = {group.split(".")[1] for group in PROFILING_RANKS}
    assert entries - {"__init__"} == tops
    roles = ast.get_docstring(ast.parse((ROOT / "profiling" / "__init__.py").read_text()))
    assert [top for top in sorted(tops) if f"`{top}`" not in roles] == []
    for path in (ROOT / "profiling").rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path} says not what it is for"


def shared_names() -> dict[str, list[str]]:
    """Base names of more than one module in ddp/, stages/, profiling/ and tests/, less the
    names of one role in parallel packages."""
    seen: dict[str, list[str]] = {}
    for top in (*LAYERS, "tests", "docs"):
        for path in sorted((ROOT / top).rglob("*.py")):
            seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    return {n: paths for n, paths in seen.items() if len(paths) > 1 and n not in SHARED_ROLES}


def test_no_two_modules_share_a_name_unless_they_share_a_role():
    assert shared_names() == {}


def local_imports(path: Path) -> list[tuple[int, bool]]:
    """(line, whether a comment says why) for each import inside a function. The reason is
    a comment on the import's line or on the lines just above it."""
    lines = path.read_text().splitlines()
    out = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    above = lines[inner.lineno - 2].strip() if inner.lineno > 1 else ""
                    said = "#" in lines[inner.lineno - 1] or above.startswith("#")
                    out.append((inner.lineno, said))
    return out


def test_imports_sit_at_the_top_of_profilings_modules_a_local_one_with_its_reason():
    found = {f"{p.relative_to(ROOT)}:{line}": said
             for p in sorted((ROOT / "profiling").rglob("*.py"))
             for line, said in local_imports(p)}  # fmt: skip
    assert [where for where, said in found.items() if not said] == []
    assert len(found) <= LOCAL_IMPORTS_MAX, sorted(found)


def test_a_local_import_without_its_reason_is_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import os\n\n\ndef f():\n    import json\n\n    # optional: absent on CPU\n"
        "    import missing\n    return json, missing, os\n"
    )
    assert local_imports(path) == [(5, False), (8, True)]


def test_no_file_in_profiling_is_over_500_lines():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in (ROOT / "profiling").rglob("*.py")}  # fmt: skip
    assert {path: n for path, n in lines.items() if n > 500} == {}


def test_a_cycle_is_found_by_hand():
    # a -> b -> c -> a is one cycle; d only points into it.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_readmes_map_names_every_group_of_profiling():
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| `profiling/` |"))  # fmt: skip
    tops = sorted({group.split(".")[1] for group in PROFILING_RANKS})
    assert [top for top in tops if f"`{top}`" not in row] == []
