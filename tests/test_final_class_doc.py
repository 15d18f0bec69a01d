"""docs/final_class.md's table of one gradient's path is traced from the code, so it cannot
understate it: the page as docs/hooks.py renders it names every (class, method) that runs in
a warm synchronised step of the drop-in, and no other, and prints how many distinct
functions that backward runs; a method a table leaves out is caught; and the 1-rank step the
docs trace runs the same methods as a step on 2 ranks. That backward, with default options,
runs few distinct functions: few stages' overrides run only to find their option off.

The trace is profiling/course/backward_path.py's, the one the docs build uses."""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from profiling.course import backward_path
from stages import STAGES
from stages.drop_in import DistributedDataParallel
from tests.pool import check_no_errors

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "final_class.md"
# Distinct functions of the project a warm synchronised backward of the drop-in runs with
# default options: 30 when every stage's override was asked at every call; torch's
# reducer does the same work in about a dozen functions of one file.
MAX_BACKWARD_FUNCTIONS = 20
CODE = re.compile(r"`([^`]+)`")
ITEM = re.compile(r"\[(?P<stage>\w+)\]\([^)]*\)|`(?P<code>[^`]+)`")


def named(markdown: str) -> set[tuple[str, str]]:
    """(owner, method) for each method a table's lines name, read as a reader reads them: a
    line's `Class.method`, or its `method` with each class of its chain after the colon (a
    stage page's link, a class in code) or the file of a plain function."""
    stage_class = {name: cls.__name__ for name, cls in STAGES.items()}
    out = set()
    lines = markdown.splitlines()
    start = lines.index(backward_path.HEADER) + 2  # past the header and its |---| line
    for row in itertools.takewhile(lambda line: line.startswith("|"), lines[start:]):
        for line in row.strip("| ").split(" | ", 1)[1].split("<br>"):
            said, _, chain = line.partition(": ")
            method = CODE.search(said).group(1)
            if "." in method:  # a helper class's method: `RuntimeStats.mark`
                out.add(tuple(method.rsplit(".", 1)))
                continue
            for item in ITEM.finditer(chain):
                owner = stage_class[item["stage"]] if item["stage"] else item["code"]
                out.add((owner, method))
    return out


def ran(traced: backward_path.Trace) -> set[tuple[str, str]]:
    return {(c.owner, c.method) for c in traced.shown()}


def assert_names_all(markdown: str, traced: backward_path.Trace) -> None:
    def said(pairs: set[tuple[str, str]]) -> list[str]:  # a plain function is file:name
        return sorted(f"{owner}{':' if '/' in owner else '.'}{method}" for owner, method in pairs)

    missing, extra = said(ran(traced) - named(markdown)), said(named(markdown) - ran(traced))
    assert not missing, f"the table leaves out {missing}, which run in the traced step"
    assert not extra, f"the table names {extra}, which the traced step did not run"


@pytest.fixture(scope="module")
def traced() -> backward_path.Trace:
    return backward_path.trace()


@pytest.fixture
def rendered(monkeypatch) -> str:
    """docs/final_class.md as the docs build's hook renders it (snippets aside)."""
    spec = importlib.util.spec_from_file_location("docs_build_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    # The build imports the stages afresh; here the suite's own classes serve, and the
    # tracing module the hook imports again is put back after the test.
    monkeypatch.setattr(hooks, "load_stages", lambda: STAGES)
    monkeypatch.setitem(sys.modules, "profiling.course.backward_path", backward_path)
    page = SimpleNamespace(file=SimpleNamespace(src_uri="final_class.md"))
    return hooks.on_page_markdown(PAGE.read_text(), page=page, config=None, files=None)


def test_the_page_names_every_method_the_step_runs(rendered: str, traced) -> None:
    assert "{{" not in rendered
    assert_names_all(rendered, traced)
    # Every point of the path the page's words describe is in the table.
    for method in backward_path.POINTS:
        assert f"`{method}`" in rendered, method


def test_the_page_prints_how_many_functions_the_backward_runs(rendered: str, traced) -> None:
    functions = backward_path.backward_functions(traced)
    assert f"The backward runs {len(functions)} distinct functions" in rendered


def test_a_warm_backward_runs_few_distinct_functions(traced) -> None:
    """Each option is chosen once, where it is set (at construction, when the buckets are
    made, at forward, at the end of backward for what depends on the step), so a backward
    with default options passes through no stage whose idea it does not use. An override
    that only checks its option and calls super() on every call adds one here."""
    functions = backward_path.backward_functions(traced)
    assert len(functions) <= MAX_BACKWARD_FUNCTIONS, (
        f"a warm synchronised backward of the drop-in with default options runs "
        f"{len(functions)} distinct functions of the project's own (at most "
        f"{MAX_BACKWARD_FUNCTIONS}); choose an option once rather than ask it per call: "
        + ", ".join(functions)
    )


class LoudSend(DistributedDataParallel):
    """A stage that extends `_send` (as drop_in's own did, which the hand-written table
    this one replaced left out): a pass-through, as an override that only checks an
    option that is off would be."""

    def _send(self, bucket):
        return super()._send(bucket)


def test_a_pass_through_override_is_one_function_more(traced) -> None:
    before = backward_path.backward_functions(traced)
    after = backward_path.backward_functions(backward_path.trace(LoudSend))
    assert len(after) == len(before) + 1, sorted(set(after) - set(before))


def test_a_method_a_table_leaves_out_is_caught(traced) -> None:
    broken = backward_path.trace(LoudSend)
    before = backward_path.table(traced)  # the table as it was, before the override
    with pytest.raises(AssertionError, match=r"leaves out \['LoudSend\._send'\]"):
        assert_names_all(before, broken)
    assert_names_all(backward_path.table(broken), broken)  # traced anew, it shows it
    assert "`_send` ×2: `LoudSend` → [missing_grads]" in backward_path.table(broken)


def trace_on(rank: int, group) -> backward_path.Trace:
    return backward_path.trace(group=group)


def test_two_ranks_run_what_the_one_rank_page_shows(pool, traced) -> None:
    for on_two in check_no_errors(pool.run(2, trace_on)):
        assert ran(on_two) == ran(traced)
        assert backward_path.table(on_two) == backward_path.table(traced)
