"""Run one of accelerate's own test scripts, and fail unless it built the drop-in.

For the harness's drop-in runs, after `stages.swap` has installed the drop-in:

    torchrun --standalone --nproc-per-node 2 -m stages.swap \
        tests/clients/accelerate_check.py .../accelerate/test_utils/scripts/test_sync.py

It counts the drop-in's constructions and, once the script returns, asserts that there
was at least one on this rank (accelerate's scripts cannot be edited to check it).
"""

from __future__ import annotations

import runpy
import sys

from stages.drop_in import DistributedDataParallel


def main(script: str) -> None:
    built = 0
    init = DistributedDataParallel.__init__

    def counting_init(self: DistributedDataParallel, *args: object, **kwargs: object) -> None:
        nonlocal built
        built += 1
        init(self, *args, **kwargs)

    DistributedDataParallel.__init__ = counting_init
    sys.argv = [script]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            raise
    assert built > 0, f"{script} built no stages.drop_in.DistributedDataParallel"
    print(f"accelerate_check: {built} drop-in DDP constructions", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
