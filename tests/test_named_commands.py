"""Every `python -m MODULE [SUBCOMMAND]` that the README, the docs or the Makefile tell a
reader to run names a module of the project that runs as a command, and a subcommand that
its command line has: a moved or renamed module fails here, not in a reader's terminal.

Read from the source, without running the commands (each would import torch and many
need root or minutes); `tests/test_command_line.py` and each tool's tests run them."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"-m ((?:stages|profiling|tests)(?:\.\w+)*)(?: ([a-z][\w-]*))?")


def named_commands(text: str) -> set[tuple[str, str | None]]:
    """(module, the word after it) for each `-m MODULE` of the project in text."""
    return {(m.group(1), m.group(2)) for m in COMMAND.finditer(text)}


def reader_facing() -> dict[tuple[str, str | None], list[str]]:
    """Each command, and the files that name it."""
    found: dict[tuple[str, str | None], list[str]] = {}
    paths = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").rglob("*.md"))]
    for path in paths:
        for command in named_commands(path.read_text()):
            found.setdefault(command, []).append(str(path.relative_to(ROOT)))
    return found


def entry_file(module: str) -> Path | None:
    """The file `python -m module` runs, if the module runs as a command."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin)
    if spec.submodule_search_locations:  # a package: its __main__
        main = origin.parent / "__main__.py"
        return main if main.exists() else None
    return origin if 'if __name__ == "__main__"' in origin.read_text() else None


def subcommands(entry: Path) -> set[str]:
    """The subcommands a command line declares, read from the entry and the `cli.py`
    beside it: each `add_parser("name", ...)`, and each key of a dict whose values are
    all names (modules: `{"name": module, ...}`)."""
    paths = [entry] + ([entry.parent / "cli.py"] if (entry.parent / "cli.py").exists() else [])
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_parser" and node.args
                    and isinstance(node.args[0], ast.Constant)):  # fmt: skip
                names.add(node.args[0].value)
            elif (isinstance(node, ast.Dict) and node.keys
                  and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                          for k in node.keys)
                  and all(isinstance(v, ast.Name) for v in node.values)):  # fmt: skip
                names |= {k.value for k in node.keys}
    return names


def problem(module: str, word: str | None) -> str | None:
    entry = entry_file(module)
    if entry is None:
        return f"{module} does not run as a command"
    names = subcommands(entry)
    if names and word is not None and word not in names and module != "stages.swap":
        return f"{module} has no subcommand {word!r} (it has {sorted(names)})"
    return None


def command_id(command: tuple[str, str | None]) -> str:
    return " ".join(word for word in command if word)


@pytest.mark.parametrize("command", sorted(reader_facing(), key=str), ids=command_id)
def test_every_command_a_reader_is_told_to_run_exists(command):
    module, word = command
    assert problem(module, word) is None, (problem(module, word), reader_facing()[command])


def test_a_command_that_moved_or_lost_its_subcommand_is_found():
    assert problem("profiling.simulate", "scale") is None
    assert problem("profiling.cluster", "up") is None
    assert problem("stages.naive", None) is None
    assert problem("profiling.anatomy", None) == "profiling.anatomy does not run as a command"
    assert problem("ddp.config", None) == "ddp.config does not run as a command"
    assert problem("profiling.simulate", "repeat").startswith(
        "profiling.simulate has no subcommand 'repeat'"
    )
    # A dict on one line, passed as an argument, counts too.
    assert problem("profiling.simulate.cpu_cluster", "buckets") is None
    assert problem("profiling.simulate.cpu_cluster", "gantt").startswith(
        "profiling.simulate.cpu_cluster has no subcommand 'gantt'"
    )
