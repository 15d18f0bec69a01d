"""What each all-reduce of ddp.collectives costs, measured and modelled.

Every flat algorithm (naive, ring, halving_doubling, tree) and Gloo's own all-reduce, timed
on tensors from 4 KiB to 256 MiB on 2 or more ranks of the shaped cluster
(`profiling.cluster`: one network namespace per rank, links shaped to a fixed rate), and
the alpha-beta-gamma model fitted to each (`model`):

    python -m profiling.collectives --world-sizes 2,3,4 --network 1gbit \\
        --json docs/results/collectives.json --markdown docs/results/collectives.md \\
        --plot docs/images/collectives.png
    python -m profiling.collectives --world-sizes 4,6 --delay-ms 1 --max-size 16MiB \\
        --json docs/results/collectives.json ... --merge   # with an emulated delay

The hierarchical algorithms run with `--algorithms hierarchical_ring,...` and
`--ranks-per-node R` (nodes of R consecutive ranks). Every link of the cluster is
alike, so that measures their phases' steps and bytes, not faster links inside a node.

The shaped links cannot add latency (no netem in the kernel this was developed on), so
`--delay-ms` makes every rank wait that long before each step's sends, inside
ddp.collectives: an emulated latency, labelled so wherever it is shown. Gloo's own
all-reduce cannot be given it and is left out of such runs.

The package: `worker` (what every rank runs: the sweep and the timing), `model` (the
cost model and its fit), `output` (the printed fit, the Markdown and the figure) and
`cli` (launching a cluster per world size, and the command line).
"""
