"""What every result written under profiling/ says about itself, written once: the
machine it was measured on, the command that produced it, its Markdown tables and the
JSON file it goes to. Used by `profiling.bench`, `profiling.compare` and
`profiling.studies.large_batch`.
"""

from __future__ import annotations

import io
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
from PIL import Image

# Figures for the docs, legible at the docs' width (about 770 px): at most 8 in wide,
# drawn at 160 dpi with 10 pt text, so text shows at about its size on the page.
FIGURE_WIDTH_IN = 8.0
FIGURE_DPI = 160
FIGURE_FONT_PT = 10


def save_figure(fig, path: str | Path) -> None:
    """Write a matplotlib figure as a PNG at FIGURE_DPI. The image is reduced to a palette
    of 256 colours: flat fills and antialiased text lose nothing visible, and the file
    is about a third of the size, which a docs site of many figures feels."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=FIGURE_DPI)
    buffer.seek(0)
    with Image.open(buffer) as image:
        palette = image.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT)
        palette.save(path, format="png", optimize=True, dpi=(FIGURE_DPI, FIGURE_DPI))


def machine() -> dict:
    """The machine and software a result was measured with: CPU model, cores (all, and
    those this process may use), torch's threads, versions, the date and the load."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "threads_per_rank": torch.get_num_threads(),  # torchrun sets OMP_NUM_THREADS=1
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        # How busy the machine was: others' work before, ours plus theirs at the end.
        "load_average_end": load_average(),
    }


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the OS has none."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def command_line(
    module: str, argv: list[str] | None = None, *, python: str = "python", note: str = ""
) -> str:
    """`python -m MODULE ARGS` as one would type it; `argv` defaults to this process's
    arguments, `python` is the interpreter or launcher as typed, and `note` (how the
    module was launched) follows the module's name in parentheses."""
    args = sys.argv[1:] if argv is None else argv
    text = f"{python} -m {module}" + (f" ({note})" if note else "")
    return text + (" " + shlex.join(args) if args else "")


def produced_by(commands: list[str], how: str = "") -> str:
    """A results fragment's first line: the commands that made it, then `how`."""
    return f"Produced by {' then '.join(f'`{c}`' for c in commands)}{how}."


def bars(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, end) intervals as matplotlib's broken_barh takes them: (start, width)."""
    return [(start, end - start) for start, end in intervals]


def markdown_table(header: list[str], body: list[list[str]], left: int = 1) -> str:
    """A Markdown table: the first `left` columns aligned left (labels), the rest right
    (numbers)."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> None:
    """`data` as indented JSON, one trailing newline; the folder made if need be."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def read_json(
    path: str | Path, command: str, key: str | None = None, writer: str | None = None
) -> dict:
    """A results file that `writer --json` wrote (`command`'s own, by default), read back
    by `command`; a missing file, one that is not JSON, or one without `key` (a results
    file of another command) stops with a message naming the file and what it lacks,
    not a traceback."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{command}: no such file: {path}") from None
    except IsADirectoryError:
        raise SystemExit(f"{command}: {path} is a directory, not a results file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise SystemExit(f"{command}: {path} is not JSON ({bad})") from None
    if key is not None and (not isinstance(data, dict) or key not in data):
        raise SystemExit(
            f"{command}: {path} holds no {key!r}: give the JSON that "
            f"`{writer or command} --json` writes"
        )
    return data
