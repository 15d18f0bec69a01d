"""The course's figures come from one measurement. `python -m profiling.course.numbers`
measures the course MLP's compute, the cost of one all-reduce call, the stages' steps and
the traced compute once, into docs/results/course-numbers.json, and times the commands
the pages give; a page quotes them as `{{ number("overlapped_step_ms") }}` and
`{{ duration("check_skip_sync") }}`, which docs/hooks.py renders. Pure text: no site
build, no measurement, well under a second.

- A figure a page writes by hand for a quantity of `quoted.QUANTITIES` (its wording, as
  the quantity's patterns give it, then a literal figure) fails, naming the placeholder.
- With the placeholders rendered, every figure quoted for one quantity agrees on every
  page: two pages cannot disagree.
- A command's time ("about 4 minutes", "~30 s") on a course page is a placeholder, every
  placeholder names a command that was timed, its text is within 1.5x of the time
  measured, and the command timed is the one the page gives beside it.

A sentence that names another workload (the benchmark tables' 256 samples per rank, the
CNN, the 1024 x 24 MLP, loopback, 4 Gbit/s), or a paragraph that opens with one, quotes
other quantities than these, and is left out of the first two checks, as are the
benchmark pages whose every table is at 256 samples per rank (OTHER_WORKLOAD_PAGES).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

from profiling.course import quoted

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(
    p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).parts[0] not in ("appendix", "results")
)
# The course's pages, whose commands' times are measured: the core path, the stage
# pages, the benchmark pages.
TIMED_PAGES = [
    p
    for p in PAGES
    if p.relative_to(DOCS).parts[0] in ("stages", "bench")
    or p.name in ("index.md", "all_reduce.md", "all_reduce_in_depth.md", "anatomy.md",
                  "the-rest.md", "benchmarks.md")
]  # fmt: skip
PLACEHOLDER = re.compile(r"\{\{\s*(?P<fn>number|duration)\((?P<arg>[^)]*)\)\s*\}\}")
NAME = re.compile(r"""["'](?P<name>\w+)["']""")
OTHER_WORKLOAD = re.compile(
    r"\b(?:batch(?: size)? 256|256 samples|--batch-size 256|CNN|1024 × 24|48 gradients|"
    r"loopback|(?<![\d.])(?:[2-9]|[1-9]\d+) Gbit/s|[2-9] ms per message|NCCL|GPUs?)\b"
)
# Benchmark pages whose tables and prose are all at 256 samples per rank: other quantities.
OTHER_WORKLOAD_PAGES = {"bench/overlap.md", "bench/bucket-size.md", "bench/networks.md",
                        "bench/later-stages.md"}  # fmt: skip
FIGURE_PAGES = [p for p in PAGES if str(p.relative_to(DOCS)) not in OTHER_WORKLOAD_PAGES]
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z*\[(`])")
DURATION = re.compile(
    r"(?:\babout|~|\btook|\btakes?)\s*\d[\d.,½]*(?:\s*(?:to|and|,)\s*\d[\d.,½]*)*\s*"
    r"(?:s|sec|seconds?|min|minutes?|hours?)\b"
)
DATA = quoted.load(quoted.DATA)


def blocks(text: str) -> list[str]:
    """A page's prose, one string per paragraph (its lines joined) or table row; code
    fences left out, and included snippets with them."""
    out, paragraph, fence = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
            continue
        if fence or "--8<--" in line:
            continue
        if not line.strip() or line.lstrip().startswith("|"):
            out.append(" ".join(paragraph))
            paragraph = []
            if line.strip():
                out.append(line)
            continue
        paragraph.append(line.strip())
    out.append(" ".join(paragraph))
    return [b for b in out if b]


def rendered(text: str) -> str:
    def one(m: re.Match) -> str:
        name = NAME.search(m.group("arg")).group("name")
        if m.group("fn") == "duration":
            return quoted.render_duration(name, DATA)
        return quoted.render(name, DATA, bare="bare" in m.group("arg").split(",", 1)[-1])

    return PLACEHOLDER.sub(one, text)


def quotes_in(text: str) -> list[tuple[str, str, str]]:
    """(quantity, figure, the words around it) for every figure the text quotes in a
    quantity's wording, outside paragraphs about another workload."""
    found = []
    for block in blocks(text):
        sentences = SENTENCE_END.split(block)
        if OTHER_WORKLOAD.search(sentences[0]):
            continue  # a paragraph that opens on another workload is about it throughout
        for sentence in sentences:
            if OTHER_WORKLOAD.search(sentence):
                continue
            for name, quantity in quoted.QUANTITIES.items():
                for pattern in quantity.patterns:
                    for m in re.finditer(pattern, sentence):
                        words = sentence[max(0, m.start() - 40) : m.end()]
                        found.append((name, m.group("v"), words))
    return found


def without_placeholders(text: str) -> str:
    return PLACEHOLDER.sub("⟨figure⟩", text)


@pytest.mark.parametrize("page", FIGURE_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_no_page_writes_a_course_figure_by_hand(page: Path) -> None:
    by_hand = quotes_in(without_placeholders(page.read_text()))
    assert not by_hand, "\n".join(
        f"{page.relative_to(ROOT)}: {figure} written by hand in {words!r}; quote the "
        f'measured figure: {{{{ number("{name}") }}}} ({quoted.QUANTITIES[name].what})'
        for name, figure, words in by_hand
    )


def test_pages_agree_on_each_figure() -> None:
    seen: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for page in FIGURE_PAGES:
        for name, figure, _ in quotes_in(rendered(page.read_text())):
            seen[name][figure.replace(",", "")].add(str(page.relative_to(DOCS)))
    disagree = {name: dict(figures) for name, figures in seen.items() if len(figures) > 1}
    assert not disagree, f"pages quote different figures for one quantity: {disagree}"


def test_every_placeholder_names_a_measured_figure_or_a_timed_command() -> None:
    bad = []
    for page in PAGES:
        for m in PLACEHOLDER.finditer(page.read_text()):
            try:
                rendered(m.group(0))
            except (KeyError, AttributeError) as e:
                bad.append(f"{page.relative_to(DOCS)}: {m.group(0)}: {e}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", TIMED_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_no_page_gives_a_commands_time_by_hand(page: Path) -> None:
    found = [
        block[max(0, m.start() - 60) : m.end()]
        for block in blocks(without_placeholders(page.read_text()))
        for m in DURATION.finditer(block)
    ]
    assert not found, (
        f"{page.relative_to(ROOT)}: times given by hand: {found}; time the command "
        "(profiling.course.numbers --time NAME, a Command of profiling.course.quoted) and quote "
        '{{ duration("NAME") }}'
    )


def test_every_time_given_is_within_1_5x_of_the_measured() -> None:
    for name, timed in DATA["durations"].items():
        text = quoted.render_duration(name, DATA)
        figure = float(re.search(r"about ([\d.]+)", text).group(1))
        seconds = figure * (60 if "minute" in text else 1)
        assert timed["seconds"] / 1.5 <= seconds <= timed["seconds"] * 1.5, (name, text, timed)
        if name != "numbers":
            assert timed["command"] == quoted.COMMANDS[name].line, (
                f"{name}: timed {timed['command']!r}, but the command is now "
                f"{quoted.COMMANDS[name].line!r}; time it again"
            )


def _options(line: str) -> list[str]:
    """A command's module and options, as a page gives it or as it was timed."""
    words = re.sub(r"[`()]|\\\n", " ", line).replace("sudo ", "").split()
    return [w for w in words if not w.startswith((".venv/", "python", "torchrun"))]


def test_each_time_given_sits_beside_the_command_timed() -> None:
    """A duration placeholder's command (its module and options, in order) is in the code
    block or the backticks that follow it on the page, so the time belongs to it."""
    misplaced = []
    for page in TIMED_PAGES:
        text = page.read_text()
        for m in PLACEHOLDER.finditer(text):
            name = NAME.search(m.group("arg")).group("name")
            if m.group("fn") != "duration" or name not in quoted.COMMANDS:
                continue  # core_path, bench_rounds: sums, of commands given elsewhere
            near = " ".join(_options(text[max(0, m.start() - 900) : m.end() + 900]))
            command = quoted.COMMANDS[name]
            if " ".join(_options(command.shown or command.line)) not in near:
                misplaced.append(f"{page.relative_to(DOCS)}: {m.group(0)}")
    assert not misplaced, f"a time given away from the command it measured: {misplaced}"


def test_figures_and_times_render_one_way() -> None:
    """The rounding every page shares, and times always within 1.5x of the measured."""
    data = {"measured": {"compute_ms": {"median": 1007.6}, "allreduce_call_us": {"median": 214.0},
                         "traced_compute_ms": {"min": 441.2, "max": 468.9},
                         "link_MBps": {"median": 4.56}}}  # fmt: skip
    assert quoted.render("compute_ms", data) == "1,008 ms"
    assert quoted.render("compute_ms", data, bare=True) == "1,008"
    assert quoted.render("allreduce_call_us", data) == "210 µs"
    assert (
        quoted.render("allreduce_call_us", {"measured": {"allreduce_call_us": {"median": 3070}}})
        == "3.1 ms"
    )
    assert quoted.render("traced_compute_ms", data) == "441–469 ms"
    assert quoted.render("link_MBps", data) == "4.6 MB/s"
    with pytest.raises(KeyError, match="no quantity"):
        quoted.render("overlaped_step_ms", data)
    for seconds in (3, 7, 29, 61, 89, 91, 100, 250, 1000, 2900):
        timed = {"durations": {"demo": {"seconds": seconds}}}
        text = quoted.render_duration("demo", timed)
        figure = float(re.search(r"about ([\d.]+)", text).group(1))
        shown = figure * (60 if "minute" in text else 1)
        assert seconds / 1.5 <= shown <= seconds * 1.5, (seconds, text)
    with pytest.raises(KeyError, match="never timed"):
        quoted.render_duration("demo", {"durations": {}})


def test_the_build_refuses_an_unknown_figure() -> None:
    import importlib.util

    from mkdocs.exceptions import PluginError

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    hooks._numbers = (quoted, DATA)  # as a build has them once loaded

    with pytest.raises(PluginError, match="no quantity 'overlaped_step_ms'"):
        hooks.course_number("number", '"overlaped_step_ms"', "x.md", "{{ number(...) }}")
    with pytest.raises(PluginError, match="no command 'check_everything'"):
        hooks.course_number("duration", '"check_everything"', "x.md", "{{ duration(...) }}")


def test_the_sliders_and_the_numbers_are_one_measurement() -> None:
    """Anatomy's page data is the compute the numbers measured, and the sliders' figures
    the pages quote are the step model's on it."""
    from profiling.course import anatomy, numbers

    page = anatomy.read_page_data(DOCS / "js/anatomy-workload.js")["models"]
    for name, measured in DATA["workloads"].items():
        shown = page[name]
        assert [shown["forward_s"], shown["backward_s"], shown["optimizer_s"]] == [
            measured["forward_s"],
            measured["backward_s"],
            measured["optimizer_s"],
        ], f"{name}: run `python -m profiling.course.anatomy --docs` after the numbers"
        assert [[g["name"], g["bytes"], g["ready_s"]] for g in shown["grads"]] == measured["grads"]
    assert numbers.simulated(DATA) == pytest.approx(DATA["simulated"])


def test_the_benchmarks_page_names_the_machine_that_measured_the_course():
    """The course's figures and the benchmark tables ran on different machines; the page
    that explains why their compute differs names the one the numbers file records, so a
    new measurement on another machine fails here until the sentence follows it."""
    cpu = quoted.load()["machine"]["cpu"]
    assert cpu in (DOCS / "benchmarks.md").read_text(), (
        f"docs/benchmarks.md does not name {cpu!r}, the machine of course-numbers.json"
    )
