"""Where the simulator's commands write: files the user owns, unless told otherwise.

By default under `runs/simulate/` in the current directory (or `--out DIR`); the docs'
own tables and figures in the repository only with `--docs`, which finds the docs from
this file's place in the checkout, whatever the current directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_OUT = Path("runs", "simulate")


def add_arguments(parser: argparse.ArgumentParser, docs: bool = True) -> None:
    """--out, --no-files, and --docs for a command whose output a docs page includes
    (docs/results holds only what a page includes)."""
    group = parser.add_argument_group("outputs")
    group.add_argument(
        "--out", type=Path,
        help=f"folder for the results (default: {DEFAULT_OUT}/ in the current directory)",
    )  # fmt: skip
    if docs:
        group.add_argument(
            "--docs", action="store_true",
            help="refresh the docs' own tables and figures in this checkout instead",
        )  # fmt: skip
    else:
        parser.set_defaults(docs=False)
    group.add_argument("--no-files", action="store_true", help="print only")


def stem(model: str) -> str:
    """A file name's part for `--model`: a preset's name, or MODULE:FACTORY made safe."""
    return model.replace(":", "-").replace(".", "_").replace("/", "_")


def repository_docs() -> Path:
    """The checkout's docs/ folder; an installed copy has none."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    if not (docs / "results").is_dir():
        raise SystemExit(f"--docs: no docs/results/ at {docs.parent}; run from a checkout")
    return docs


def folders(args: argparse.Namespace) -> tuple[Path, Path]:
    """(results folder, figures folder) the command writes into, created."""
    if args.docs:
        docs = repository_docs()
        results, images = docs / "results", docs / "images"
    else:
        results = images = args.out or DEFAULT_OUT
    results.mkdir(parents=True, exist_ok=True)
    images.mkdir(parents=True, exist_ok=True)
    return results, images
