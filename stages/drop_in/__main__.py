"""`torchrun --standalone --nproc-per-node 2 -m stages.drop_in --model cnn`: train with the
drop-in, report and check, as every `-m stages.<name>` run does. It sits here, not at the
end of the package's `__init__.py`, so that the stage module is imported once, as
`stages.drop_in`, and not again as `__main__`."""

from ddp.train import main
from stages.drop_in import DistributedDataParallel

if __name__ == "__main__":
    main(DistributedDataParallel)
