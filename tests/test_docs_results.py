"""docs/results/ holds only files that a page includes or a test reads. A run kept "just in
case", or one a page only mentions, is history: the git log keeps it. Such a file fails
here by name: include it from a page, read it in a test, or `git rm` it.

What counts as a reference to docs/results/NAME:

- In a page (every .md under docs/ outside docs/results/): a snippet include
  (`--8<-- "docs/results/NAME"`). A link does not count (mkdocs.yml leaves docs/results/
  out of the site, so a link there is dead), nor a path in prose or in a command, nor a
  bare NAME: a page's own name (large-batch.md) can be a fragment's too.
- In the site's code (mkdocs.yml, and the .py, .js, .html and .css under docs/): the
  text `results/NAME`, which the build or the page's script reads.
- In a fragment under docs/results/ that is itself used (a table a page includes): the
  same, so the JSON a fragment's "Produced by" command wrote counts through it. Only
  used fragments pass references on, so two unused files cannot keep each other.
- In a test (a .py under tests/, or docs/hooks.py) that points at the folder, by the
  text `docs/results` or a string literal "results" (`ROOT / "docs" / "results"`):
  the text `results/NAME`, a string literal equal to NAME, or a stem pattern that
  matches NAME: an f-string with its fields as wildcards
  (`f"simulate-validate-{run}.json"`) or a glob (`"bench-auto-*.json"`). A pattern
  needs at least MIN_STEM literal characters before its first wildcard, so
  `f"{name}.json"` does not claim every file. A test that names a file without
  pointing at the folder (a command's output under tmp_path) does not count.

Commands that write into docs/results/ (`--docs`, or `--json docs/results/...`) should
write there only what a page uses: one that writes more makes this test fail after it
runs, naming the file.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIN_STEM = 4  # literal characters before a pattern's first wildcard
DOC_SOURCES = {".md", ".py", ".js", ".html", ".css", ".yml", ".yaml"}
NAME_END = r"(?![\w.-])"  # results/x.json is not results/x.json.bak nor results/x.json-2


def named_in_text(name: str, text: str) -> bool:
    return re.search(rf"results/{re.escape(name)}{NAME_END}", text) is not None


def included(name: str, text: str) -> bool:
    """A page's snippet include of the file, or of a section of it."""
    include = rf"--8<--\s*\"[^\"]*results/{re.escape(name)}(?::[\w-]+)?\""
    return re.search(include, text) is not None


def literal_patterns(source: str) -> tuple[set[str], list[re.Pattern]]:
    """A Python file's string literals: the plain ones, and the f-strings and globs as
    regular expressions (an f-string's fields and a glob's * and ? match any characters
    but /). Only the part after the last / is kept, so "docs/results/x.json" is x.json."""
    plain: set[str] = set()
    patterns: list[re.Pattern] = []
    tree = ast.parse(source)
    fstring_parts = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            pieces = []
            for value in node.values:
                fstring_parts.add(id(value))
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    pieces.append(("literal", value.value))
                else:
                    pieces.append(("field", ""))
            _add_pattern(pieces, patterns)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in fstring_parts
        ):
            text = node.value.rsplit("/", 1)[-1]
            if "*" in text or "?" in text:
                stem = re.split(r"[*?\[]", text, maxsplit=1)[0]
                if len(stem) >= MIN_STEM:
                    patterns.append(re.compile(fnmatch.translate(text)))
            else:
                plain.add(text)
    return plain, patterns


def _add_pattern(pieces: list[tuple[str, str]], patterns: list[re.Pattern]) -> None:
    # Keep what follows the last / in a literal piece: the file's name, not its folder.
    for i in range(len(pieces) - 1, -1, -1):
        kind, text = pieces[i]
        if kind == "literal" and "/" in text:
            pieces = [("literal", text.rsplit("/", 1)[-1]), *pieces[i + 1 :]]
            break
    if not any(kind == "field" for kind, _ in pieces):
        return
    stem = ""
    for kind, text in pieces:
        if kind == "field":
            break
        stem += text
    if len(stem) < MIN_STEM:
        return
    regex = "".join(re.escape(text) if kind == "literal" else "[^/]+" for kind, text in pieces)
    patterns.append(re.compile(regex + r"\Z"))


def unreferenced(root: Path) -> list[str]:
    """The names of the files in root/docs/results/ that nothing references (see the
    module's docstring for what counts)."""
    results = root / "docs" / "results"
    names = sorted(p.name for p in results.iterdir() if p.is_file())
    docs = root / "docs"

    site_code = [(root / "mkdocs.yml").read_text()]
    pages = []
    for path in sorted(docs.rglob("*")):
        if path.is_file() and path.suffix in DOC_SOURCES and results not in path.parents:
            (pages if path.suffix == ".md" else site_code).append(path.read_text(errors="replace"))
    used = {n for n in names if any(included(n, t) for t in pages)}
    used |= {n for n in names if any(named_in_text(n, t) for t in site_code)}

    code = [p for p in sorted((root / "tests").rglob("*.py")) if p.name != Path(__file__).name]
    code.append(docs / "hooks.py")
    for path in code:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        plain, patterns = literal_patterns(text)
        if "docs/results" not in text and "results" not in plain:
            continue  # names of its own outputs, under tmp_path, say
        for n in names:
            if n in plain or named_in_text(n, text) or any(p.match(n) for p in patterns):
                used.add(n)

    # Fragments a page uses pass on what they name: the JSON behind an included table.
    todo = [n for n in used if n.endswith(".md")]
    while todo:
        text = (results / todo.pop()).read_text(errors="replace")
        for n in names:
            if n not in used and named_in_text(n, text):
                used.add(n)
                if n.endswith(".md"):
                    todo.append(n)
    return [n for n in names if n not in used]


def test_every_file_in_docs_results_is_used():
    stray = unreferenced(ROOT)
    assert not stray, (
        f"{len(stray)} file(s) in docs/results/ that no page includes or names "
        "and no test reads: "
        + ", ".join(stray)
        + ". Include each from a page under docs/, read it in a test, "
        "or `git rm` it."
    )


def test_what_counts_as_a_reference(tmp_path):
    """The rules above, on a small tree: a page's include, a test's f-string pattern, a
    used fragment's command; and what does not count (a link, a path in prose)."""
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "mkdocs.yml").write_text("nav:\n  - Large minibatches: large-batch.md\n")
    (tmp_path / "docs" / "hooks.py").write_text("")
    (tmp_path / "docs" / "page.md").write_text(
        '--8<-- "docs/results/table.md"\n\n'
        "Kept as `docs/results/run-a.json` and `.md`; see also `loose.json`.\n"
        "The [data](../results/linked.json).\n"
    )
    (tmp_path / "tests" / "test_x.py").write_text(
        "from pathlib import Path\n"
        'RESULTS = Path("docs") / "results"\n'
        'def test(run="v"):\n'
        '    RESULTS / f"simulate-validate-{run}.json"\n'
        '    RESULTS / "kept.json"\n'
        '    RESULTS.glob("bench-auto-*.md")\n'
        '    RESULTS / f"{run}.json"\n'
    )
    (tmp_path / "tests" / "test_y.py").write_text(  # a command's own output
        'def test_writes_its_results(tmp_path):\n    (tmp_path / "paper.json").read_text()\n'
    )
    files = {
        "table.md": "Produced by `cmd --json docs/results/table.json`.",
        "table.json": "{}",
        "run-a.json": "{}",
        "linked.json": "{}",
        "run-a.md": "Produced by `cmd --json docs/results/orphan.json`.",
        "orphan.json": "{}",
        "loose.json": "{}",
        "simulate-validate-v.json": "{}",
        "kept.json": "{}",
        "bench-auto-x.md": "",
        "large-batch.md": "",
        "paper.json": "{}",
        "other.json": "{}",
    }
    for name, text in files.items():
        (tmp_path / "docs" / "results" / name).write_text(text)
    assert unreferenced(tmp_path) == [
        "large-batch.md",  # mkdocs.yml names the page, not the fragment
        "linked.json",  # a link: results/ is not on the site
        "loose.json",  # a bare name in prose
        "orphan.json",  # named only by an unused fragment
        "other.json",  # f"{run}.json" has no stem
        "paper.json",  # named by a test that never points at docs/results
        "run-a.json",  # a path in prose
        "run-a.md",  # "and `.md`" names no file
    ]


def test_no_page_links_into_results():
    # mkdocs.yml leaves docs/results/ out of the site, and strict mode only logs such a
    # link: include the fragment, or link the page that includes it.
    links = {str(p.relative_to(ROOT)): re.findall(r"\]\(([^)\s]*results/[^)\s]+)\)", p.read_text())
             for p in sorted((ROOT / "docs").rglob("*.md"))
             if (ROOT / "docs" / "results") not in p.parents}  # fmt: skip
    assert {page: found for page, found in links.items() if found} == {}
