"""Not a stage: run a script, unchanged, with the drop-in where torch's DDP was.

A framework (HF accelerate, PyTorch Lightning) or a script that builds torch's
`DistributedDataParallel` itself builds `stages.drop_in.DistributedDataParallel`
instead: this launcher calls `stages.drop_in.install()` and then runs the script (or,
with `-m`, the module) as `python` would, with its own arguments.

    torchrun --standalone --nproc-per-node 2 -m stages.swap train.py --epochs 1
    torchrun --standalone --nproc-per-node 2 -m stages.swap -m my_package.train

A framework that starts its own processes by running the script again (Lightning
without torchrun) starts them without this launcher: call `install()` in the script
instead (docs: "Using the drop-in with your framework").
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from stages.drop_in import install


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if args else 2)
    install()
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit("stages.swap: -m needs a module name")
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, str(Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
