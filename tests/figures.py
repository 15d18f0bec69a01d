"""What the figure tests check: the docs show figures at about 8 in (the page's width),
so a PNG drawn at most 8.5 in wide at >= 150 dpi with no text under 10 pt reads at
about 10 pt."""

from __future__ import annotations

from pathlib import Path


def record_font_sizes(monkeypatch) -> list[float]:
    """A list that fills, while the test runs, with the size in points of every visible
    text matplotlib draws."""
    import matplotlib.text

    sizes: list[float] = []
    real_draw = matplotlib.text.Text.draw

    def draw(self, renderer):
        if self.get_visible() and self.get_text():
            sizes.append(self.get_fontsize())
        return real_draw(self, renderer)

    monkeypatch.setattr(matplotlib.text.Text, "draw", draw)
    return sizes


def assert_legible(path: Path, sizes: list[float]) -> None:
    from PIL import Image

    with Image.open(path) as image:
        dpi = image.info["dpi"][0]
        width_in = image.width / dpi
    assert dpi >= 150 and width_in <= 8.5, (path.name, dpi, width_in)
    assert sizes and min(sizes) >= 10, (path.name, sorted(set(sizes)))
