"""Run at the start of every Python process that a `python -m stages.swap` run starts:
the `sitecustomize` this folder hides, if there is one, then `stages.drop_in.install()`.
So ranks that a framework starts as fresh interpreters (`torch.multiprocessing.spawn`,
ignite's `idist.Parallel`, a launcher that runs the script again) build the drop-in too.

`stages/swap.py` puts this folder first on PYTHONPATH, where Python's `site` module
imports the first `sitecustomize` it finds, once, at start-up; and it names its own
interpreter in DDP_STAGES_SWAP. A process of another interpreter (another virtual
environment, the system's Python) is left alone: it may have neither torch nor this
project. Everything in this folder is importable in every such process: it holds this
file only.
"""

import importlib.util
import os
import sys
from importlib.machinery import PathFinder

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the folder that holds `stages`


def run_hidden_sitecustomize() -> None:
    """The sitecustomize that Python would have run without this folder on the path."""
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != HERE]
    spec = PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def install_drop_in() -> None:
    if os.environ.get("DDP_STAGES_SWAP") != sys.prefix:
        return  # not a swapped run's interpreter
    # This project, whatever the process's own path (the parent's `python -m` found it in
    # its working directory); taken off again, so the process's path is what it would be.
    sys.path.insert(0, ROOT)
    try:
        import stages.drop_in
    finally:
        sys.path.remove(ROOT)
    stages.drop_in.install()


try:
    run_hidden_sitecustomize()
finally:
    install_drop_in()
