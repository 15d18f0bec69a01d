"""The course's schematic drawings (profiling/course/drawings.py) at page width."""

from __future__ import annotations


def test_course_drawings_are_legible(tmp_path, monkeypatch) -> None:
    from profiling.course.drawings import main as draw
    from tests.figures import assert_legible, record_font_sizes

    sizes = record_font_sizes(monkeypatch)
    draw(["--out", str(tmp_path)])
    for name in ("missing-gradient.png", "uneven-inputs.png", "kill-restart-resume.png"):
        assert_legible(tmp_path / name, sizes)
