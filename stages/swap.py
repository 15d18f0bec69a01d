"""Not a stage: run a script, unchanged, with the drop-in where torch's DDP was.

A framework (HF accelerate, PyTorch Lightning) or a script that builds torch's
`DistributedDataParallel` itself builds `stages.drop_in.DistributedDataParallel`
instead: this launcher calls `stages.drop_in.install()` and then runs the script (or,
with `-m`, the module) as `python` would, with its own arguments.

    torchrun --standalone --nproc-per-node 2 -m stages.swap train.py --epochs 1
    torchrun --standalone --nproc-per-node 2 -m stages.swap -m my_package.train
    python -m stages.swap train_with_ignite.py      # ranks started by the framework

A framework that starts its ranks as new Python processes (ignite's
`idist.Parallel(nproc_per_node=2)`, `torch.multiprocessing.spawn`, `multiprocessing`
with the spawn start method; Lightning without torchrun, which runs the script again)
starts fresh interpreters, without this launcher's swap. They get it anyway: before
the script runs, this launcher puts `stages/swap_site/` first on PYTHONPATH, so every
Python process of the run with this interpreter (DDP_STAGES_SWAP names it) calls
`install()` at start-up, from that folder's `sitecustomize.py`, after the
`sitecustomize` it hides, if any (tests/test_frameworks.py checks it with
`torch.multiprocessing.spawn`). Each such process, a data loader's worker or a
compiler's too, then imports torch and the drop-in as it starts. A process started with
an environment of its own that drops PYTHONPATH, or with `python -I`, is not reached:
call `install()` in the script there (docs: "Using the drop-in with your framework").
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from stages.drop_in import install

SITE = Path(__file__).resolve().parent / "swap_site"  # holds sitecustomize.py, alone


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if args else 2)
    install()
    reach_new_processes()
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit("stages.swap: -m needs a module name")
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, str(Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")


def reach_new_processes() -> None:
    """Every Python process this one starts, and theirs, installs the drop-in as it
    starts (`swap_site/sitecustomize.py`), if it runs this interpreter."""
    os.environ["DDP_STAGES_SWAP"] = sys.prefix
    path = os.environ.get("PYTHONPATH", "")
    if path.split(os.pathsep)[0] != str(SITE):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), path) if p)


if __name__ == "__main__":
    main()
