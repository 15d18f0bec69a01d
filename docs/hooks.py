"""mkdocs hook: write each stage page's "what changed" section from the code itself.

A page says `{{ stage_diff("bucketed") }}`; the build replaces it with one block per
method whose definition changed between the previous stage in `stages.STAGES` and this
one: a unified diff for a method the stage replaces, the lines added around the
`super()` call for one it extends, a pointer to the page's snippet for a new method the
page already shows, folded (pymdownx.details) when longer than FOLD_LINES lines. The
stages are subclasses, each file holding only its new idea, so these blocks *are* the
idea, and they cannot go stale: they are computed from the classes on every build.

`{{ backward_path() }}` (docs/final_class.md) becomes the table of which method of which
stage runs at each point of one gradient's path, traced from one warm step of the drop-in
on a 1-rank Gloo group in this process (`profiling/course/backward_path.py`, well under a
second), so it cannot name fewer methods than run.

`{{ number("overlapped_step_ms") }}` becomes a figure the course quotes, `{{
duration("check_skip_sync") }}` the time a command the page gives takes ("about 4
minutes"), both from `docs/results/course-numbers.json`, which one command measures
(`profiling/course/numbers.py`), rounded the same way on every page
(`profiling/course/quoted.py`, which defines each name); `{{ number("compute_ms", "bare")
}}` leaves the unit out. A name that is not defined fails the build.

Also makes relative `pymdownx.snippets` base paths relative to mkdocs.yml, so the build
works from any directory, not only the repository root.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import linecache
import posixpath
import re
import sys
import textwrap
from pathlib import Path

import torch
from mkdocs.exceptions import PluginError

FUNCTIONS = "stage_diff|backward_path|number|duration"
PLACEHOLDER = re.compile(rf"\{{\{{\s*(?P<fn>{FUNCTIONS})\((?P<arg>.*?)\)\s*\}}\}}")
QUOTED_NAME = re.compile(r"""\s*(?P<q>["'])(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P=q)\s*""")
BARE = re.compile(r"""\s*,\s*(?P<q>["'])bare(?P=q)\s*$""")  # number("name", "bare")
LEFTOVER = re.compile(rf"\{{\{{[^\n]*?({FUNCTIONS})[^\n]*")  # e.g. one missing its }}
# A snippet line after a Python formatter took it for code (ruff 0.16+ formats ```python
# fences in Markdown): snippets no longer sees it and would print it as text, silently.
MANGLED_SNIPPET = re.compile(r"^[ \t]*-+8\s+<\s+-+\s*[\"'].*$", re.M)
# Snippet section markers are docs plumbing, not code: leave them out of the diffs.
SECTION_MARKER = re.compile(r"^\s*#\s*-+8<-+\s*\[\s*(start|end)\s*:")
INCLUDE = re.compile(r"""^[ \t]*-+8<-+[ \t]+["'](?P<path>[^"':]+):(?P<section>[\w-]+)["']""", re.M)
DEF = re.compile(r"^\s*(?:async\s+)?def\s+(?P<name>\w+)\s*\(", re.M)
FOLD_LINES = 30  # a diff longer than this is folded into a collapsible block

_root = Path(__file__).resolve().parent.parent  # replaced by mkdocs.yml's folder in on_config
_stages: dict[str, type] | None = None
_backward_path: tuple | None = None  # (the tracing module, its trace), once per build
_numbers: tuple | None = None  # (profiling.course.numbers, its data), once per build


def on_config(config):
    global _root, _stages, _backward_path, _numbers
    _root = Path(config.config_file_path).resolve().parent
    snippets = config.mdx_configs.get("pymdownx.snippets", {})
    if "base_path" in snippets:
        paths = snippets["base_path"]
        paths = [paths] if isinstance(paths, str) else paths
        snippets["base_path"] = [str(_root / p) for p in paths]
    _stages = None  # re-import on every build, so `mkdocs serve` shows edited stages
    _backward_path = None
    _numbers = None
    return config


def on_page_markdown(markdown, page, config, files):
    mangled = MANGLED_SNIPPET.search(markdown)
    if mangled:
        raise PluginError(
            f"{page.file.src_uri}: {mangled.group(0).strip()!r} is a snippet include that a "
            'code formatter rewrote; restore it to --8<-- "path:section" and keep include '
            "fences as ``` { .python }, which ruff format leaves alone"
        )

    def replace(match: re.Match) -> str:
        fn, arg = match.group("fn"), match.group("arg")
        if fn == "backward_path":
            if arg.strip():
                raise PluginError(
                    f"{page.file.src_uri}: bad placeholder {match.group(0)!r}; "
                    "write {{ backward_path() }}"
                )
            return backward_path(page.file.src_uri)
        if fn in ("number", "duration"):
            return course_number(fn, arg, page.file.src_uri, match.group(0))
        quoted = QUOTED_NAME.fullmatch(arg)
        if quoted is None:
            raise PluginError(
                f"{page.file.src_uri}: bad placeholder {match.group(0)!r}; "
                f'write {{{{ {fn}("<name>") }}}}'
            )
        return stage_diff(
            quoted.group("name"), where=page.file.src_uri, shown=_shown_on_page(markdown)
        )

    markdown = PLACEHOLDER.sub(replace, markdown)
    leftover = LEFTOVER.search(markdown)
    if leftover:
        raise PluginError(f"{page.file.src_uri}: malformed placeholder near {leftover.group(0)!r}")
    return markdown


def load_stages() -> dict[str, type]:
    """`stages.STAGES`, freshly imported from the repository root."""
    global _stages
    if _stages is None:
        if str(_root) in sys.path:  # first, ahead of any installed copy of the package
            sys.path.remove(str(_root))
        sys.path.insert(0, str(_root))
        for name in [m for m in sys.modules if m == "stages" or m.startswith("stages.")]:
            del sys.modules[name]
        linecache.checkcache()
        _stages = dict(importlib.import_module("stages").STAGES)
    return _stages


def backward_path(where: str = "final_class.md") -> str:
    """The traced table of one gradient's path, linking the stage pages from the page at
    `where` (a path under docs/)."""
    global _backward_path
    stages = load_stages()  # also puts the repository root first on sys.path
    if _backward_path is None:
        sys.modules.pop("profiling.course.backward_path", None)  # fresh, as the stages are
        tracer = importlib.import_module("profiling.course.backward_path")
        _backward_path = (tracer, tracer.trace(stage_classes=stages))
    tracer, traced = _backward_path
    up = posixpath.relpath("stages", posixpath.dirname(where) or ".")
    return tracer.page_text(traced, stage_link=up + "/{}.md")


def course_number(fn: str, arg: str, where: str, placeholder: str) -> str:
    """A figure (`number`) or a command's time (`duration`) as profiling/course/numbers.py
    renders it from the committed measurements."""
    global _numbers
    if _numbers is None:
        load_stages()  # puts the repository root first on sys.path
        sys.modules.pop("profiling.course.quoted", None)  # fresh, as the stages are
        numbers = importlib.import_module("profiling.course.quoted")
        _numbers = (numbers, numbers.load(_root / "docs/results/course-numbers.json"))
    numbers, data = _numbers
    bare = BARE.search(arg) if fn == "number" else None
    quoted = QUOTED_NAME.fullmatch(arg[: bare.start()] if bare else arg)
    if quoted is None:
        raise PluginError(
            f'{where}: bad placeholder {placeholder!r}; write {{{{ {fn}("<name>") }}}}'
        )
    try:
        if fn == "number":
            return numbers.render(quoted.group("name"), data, bare=bare is not None)
        return numbers.render_duration(quoted.group("name"), data)
    except KeyError as e:
        raise PluginError(f"{where}: {placeholder}: {e.args[0]}") from None


def _shown_on_page(markdown: str) -> dict[str, dict[str, str]]:
    """file -> {method: section} for every method the page includes by snippet section."""
    shown: dict[str, dict[str, str]] = {}
    for include in INCLUDE.finditer(markdown):
        path, section = include.group("path"), include.group("section")
        try:
            text = (_root / path).read_text()
        except OSError:
            continue  # snippets itself reports a missing file
        block = re.search(
            rf"\[start:{re.escape(section)}\](?P<body>.*?)\[end:{re.escape(section)}\]",
            text,
            re.S,
        )
        if block:
            for d in DEF.finditer(block.group("body")):
                shown.setdefault(path, {}).setdefault(d.group("name"), section)
    return shown


def stage_diff(name: str, where: str = "?", shown: dict[str, dict[str, str]] | None = None) -> str:
    stages = load_stages()
    if name not in stages:
        raise PluginError(
            f"{where}: stage_diff({name!r}) names no stage; stages.STAGES has {list(stages)}"
        )
    order = list(stages)
    cls = stages[name]
    previous = stages[order[order.index(name) - 1]] if order.index(name) > 0 else None
    now, before = _methods(cls), (_methods(previous) if previous else {})
    changed = [m for m in now if m not in before or before[m][1] is not now[m][1]]
    removed = [m for m in before if m not in now]

    out = []
    if previous is None:
        out.append(
            f"`{cls.__name__}` is the first stage. It subclasses "
            f"{_class_names(cls.__bases__)} directly, so every method below is new; the "
            "ones that override a torch method say so."
        )
    else:
        relation = (
            f"subclasses `{previous.__name__}`"
            if cls.__bases__ == (previous,)
            else f"follows `{previous.__name__}` (its bases: {_class_names(cls.__bases__)})"
        )
        out.append(
            f"`{cls.__name__}` ({_file(cls)}) {relation} and changes {_count(changed, removed)}; "
            f"everything else is `{previous.__name__}`'s, unchanged. A method this stage "
            "replaces is a diff from the one it replaces (`-`) to this stage's (`+`); one it "
            "extends shows, `+`, what it adds around its `super()` call; a new one is shown "
            "once, here or in the page above."
        )
    out.append("*Generated at build time from `stages.STAGES` by `docs/hooks.py`.*")

    on_page = (shown or {}).get(_path(cls), {})
    for method in changed:
        owner, func = now[method]
        new_src = _source(func)
        if method in before:
            old_owner, old_func = before[method]
            note = f"Overrides `{old_owner.__name__}.{method}` ({_file(old_owner)})."
            if _calls_super(func, method) and _via_super(cls, method) is old_func:
                note += (
                    f" It extends it: the unmarked `super().{method}(...)` line runs "
                    f"`{old_owner.__name__}.{method}` unchanged, and the `+` lines are what "
                    "this stage adds around that call."
                )
                body = _around_super(new_src, method)
            else:
                note += " It replaces it: the `-` lines no longer run."
                body = _diff(
                    _source(old_func),
                    new_src,
                    f"{old_owner.__name__}.{method}",
                    f"{owner.__name__}.{method}",
                )
        else:
            overridden = _torch_definer(cls, method)
            note = "New method." if overridden is None else f"New; overrides `{overridden}`."
            if method in on_page:
                out += [
                    f"### `{method}`",
                    f"{note} Shown in full in the page's `{on_page[method]}` section above.",
                ]
                continue
            body = _diff("", new_src, "(none)", f"{owner.__name__}.{method}")
        out += [f"### `{method}`", note, _fold(method, "```diff\n" + body + "\n```")]

    for method in removed:
        owner, _ = before[method]
        out += [f"### `{method}`", f"Removed: `{owner.__name__}` had it, this stage does not."]
    if not changed and not removed:
        out.append("No method changed.")
    return "\n\n".join(out) + "\n"


def _calls_super(func, method: str) -> bool:
    """Whether the method's body calls the same method one step up the MRO."""
    body = inspect.getsource(inspect.unwrap(func))
    return re.search(rf"super\([^)]*\)\.{re.escape(method)}\b", body) is not None


def _count(changed: list[str], removed: list[str]) -> str:
    n = len(changed) + len(removed)
    return f"{n} method" if n == 1 else f"{n} methods"


def _methods(cls: type) -> dict[str, tuple[type, object]]:
    """Every method the stage classes in `cls`'s MRO define, resolved as Python would:
    name -> (defining class, function). torch's own classes are left out."""
    found: dict[str, tuple[type, object]] = {}
    stage_classes = [c for c in cls.__mro__ if c.__module__.split(".")[0] == "stages"]
    for klass in stage_classes:
        for attr, value in vars(klass).items():
            func = _function(value)
            if func is not None and attr not in found:
                found[attr] = (klass, func)
    first_line = {a: inspect.getsourcelines(f)[1] for a, (_, f) in found.items()}
    # Source order, in the file of the class that defines the method.
    return dict(sorted(found.items(), key=lambda kv: (_file(kv[1][0]), first_line[kv[0]])))


def _function(value: object):
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    if inspect.isfunction(value):
        return value
    return None


def _via_super(cls: type, method: str):
    for klass in cls.__mro__[1:]:
        if method in vars(klass):
            return _function(vars(klass)[method])
    return None


def _torch_definer(cls: type, method: str) -> str | None:
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] != "stages" and method in vars(klass):
            if klass is object:
                return None  # object.__init__ and friends: nothing worth naming
            return f"{_class_name(klass)}.{method}"
    return None


def _source(func) -> str:
    """The function's source, dedented, decorators included, snippet markers removed."""
    lines = inspect.getsource(inspect.unwrap(func)).splitlines()
    return textwrap.dedent("\n".join(line for line in lines if not SECTION_MARKER.match(line)))


def _around_super(new: str, method: str) -> str:
    """The method as diff lines: the signature (decorators too) and the `super()` call
    unmarked, every line this stage adds `+`."""
    lines, out = new.splitlines(), []
    depth = 0  # open brackets of a super() call that spans lines
    in_signature = True
    for line in lines:
        is_super = depth > 0 or re.search(rf"super\([^)]*\)\.{re.escape(method)}\b", line)
        if is_super:
            depth += line.count("(") + line.count("[") - line.count(")") - line.count("]")
            depth = max(depth, 0)
        if in_signature or is_super:
            out.append(" " + line)
        else:
            out.append("+" + line)
        if in_signature and re.match(r"\s*(async\s+)?def\b", line):
            in_signature = not line.rstrip().endswith(":")
        elif in_signature and not line.lstrip().startswith("@"):
            in_signature = not line.rstrip().endswith(":")
    return "\n".join(out)


def _fold(method: str, block: str) -> str:
    """A long block inside a collapsible note (pymdownx.details), closed by default."""
    n = block.count("\n") - 1
    if n <= FOLD_LINES:
        return block
    return f'??? note "`{method}`: {n} lines"\n\n' + textwrap.indent(block, "    ")


def _diff(old: str, new: str, old_name: str, new_name: str) -> str:
    old_lines, new_lines = old.splitlines(), new.splitlines()
    whole = max(len(old_lines), len(new_lines))  # context: show each method whole
    lines = list(
        difflib.unified_diff(old_lines, new_lines, old_name, new_name, n=whole, lineterm="")
    )
    # Hunk headers count lines from the top of the method, not of the file: drop them.
    return "\n".join(line for line in lines if not line.startswith("@@"))


def _file(cls: type) -> str:
    return f"`{_path(cls)}`"


def _path(cls: type) -> str:
    """The file that defines `cls`, relative to the repository root where it is inside."""
    path = Path(inspect.getsourcefile(cls)).resolve()
    try:
        return path.relative_to(_root).as_posix()
    except ValueError:
        return str(path)


def _class_name(klass: type) -> str:
    """`NaiveDDP` for a stage class, the public dotted name for anything else."""
    if klass.__module__.split(".")[0] == "stages":
        return klass.__qualname__
    if klass is torch.nn.Module:
        return "torch.nn.Module"  # not torch.nn.modules.module.Module
    return f"{klass.__module__}.{klass.__qualname__}"


def _class_names(classes: tuple[type, ...]) -> str:
    return ", ".join(f"`{_class_name(klass)}`" for klass in classes)
