"""The course's schematic drawings (profiling/course/drawings.py) at page width."""

from __future__ import annotations


def test_course_drawings_are_legible(tmp_path, monkeypatch) -> None:
    from profiling.course.drawings import main as draw
    from tests.figures import assert_legible, record_font_sizes

    sizes = record_font_sizes(monkeypatch)
    draw(["--out", str(tmp_path)])
    for name in ("missing-gradient.png", "uneven-inputs.png", "kill-restart-resume.png"):
        assert_legible(tmp_path / name, sizes)


def test_ring_figure_numbers_its_steps_as_the_all_reduce_page_does() -> None:
    """docs/images/ring.png's panel titles and the all_reduce page's table (4 ranks) name
    the reduce-scatter steps alike, from 0 as `_ring`'s loops count."""
    import re
    from pathlib import Path

    from profiling.course.ring_figure import ring_steps

    page = (Path(__file__).resolve().parent.parent / "docs/all_reduce.md").read_text()
    in_table = re.findall(r"^\| (reduce-scatter \d+) \|", page, re.M)
    drawn = [label for label, _, _ in ring_steps(4) if label.startswith("reduce-scatter")]
    assert in_table == drawn == ["reduce-scatter 0", "reduce-scatter 1", "reduce-scatter 2"]
