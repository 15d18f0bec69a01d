"""Benchmark: every stage's step time against torch's DDP and compute-only, interleaved.

    python -m profiling.bench --nproc 2 --model mlp --width 2048 --depth 6 --batch-size 64 \
        --rounds 30 --steps 5 --json out.json --markdown out.md

Run like this, the module launches `torchrun --standalone --nproc-per-node N` on itself
(a subprocess with the same Python), so one command does everything. Under a launcher
of your own it runs directly, and the launcher's WORLD_SIZE replaces --nproc:

    torchrun --standalone --nproc-per-node 2 -m profiling.bench --model cnn --rounds 30

With --network 1gbit (any tc rate) the ranks run on a shaped network instead of
loopback: `profiling.cluster` puts each rank in a network namespace of its own, with a
link limited to that rate each way, measures Gloo's all-reduce bandwidth across it
(recorded with the results), runs the benchmark as one torchrun node per namespace, and
removes the namespaces afterwards. It needs root; where the cluster cannot be made, the
benchmark says why and runs on loopback, and the results say loopback.

Method. Every variant (compute_only, each stage in `stages.STAGES`, torch_ddp) is built
once, model, wrapper and optimizer, and trained for --warmup-steps untimed steps. Then
--rounds rounds: each round runs every variant for --round-warmup untimed and --steps
timed steps, in an order rotated by one each round, so a slow spell on a shared machine
hits every variant alike. Every step starts at a barrier and its time is the slowest
rank's. All variants see the same batches. The step is `ddp.train.train`'s: for each of
--accumulation-steps micro-batches forward, cross-entropy, backward (inside no_sync()
but for the last, where the wrapper has it), finish_gradient_synchronization; then the
SGD(momentum) step and zero_grad. Every rank holds glibc's heap steady first
(`ddp.heap`), so that a variant's step does not cost more for what another freed.

The perfect-overlap bound. Two more things are timed in the same rounds: inside every
compute_only step, the time from its start to the end of the last micro-batch's forward
(F: with one micro-batch, the forward; nothing can be communicated before it ends) and
from the optimizer step's start to the step's end (O: nothing can update before the
last all-reduce ends); and a variant `communication_alone`, which all-reduces the
gradient buckets (ddp.buckets.assign_buckets at the same bucket cap, the stages'
layout) back to back with no compute, launched asynchronously in bucket order and
waited for, timed like a step (A). No wrapper that synchronises once per step can beat

    bound = max(compute_only, F + A + O)

since compute and communication at best overlap completely. Every figure here is the
median of the slowest rank per step.

The achievable bound is tighter: communication cannot start before the gradients of a
bucket exist. The compute_only steps also record when each gradient became ready (a
hook on each parameter, seconds after the step's start), and communication_alone when
each bucket's all-reduce ended. Replaying the overlapped schedule with no contention,
bucket i's all-reduce starts once its last gradient is ready and bucket i - 1's has
ended, and takes its share, by bytes, of communication_alone's time (Gloo runs two
collectives of a group at once, so consecutive end times come in pairs); with E the end
of the last one,

    achievable = max(compute_only, E + O)

for communication_alone's layout (reverse parameter order at the cap). Medians per
gradient and per bucket, overall and per round; the old bound keeps its name and
meaning.

Reported per variant: median, min and max over all timed steps; the ratio of medians to
torch_ddp, to compute_only, to the bound and to the achievable bound; the ratio to
torch_ddp and to the bound within each round (paired, so both sides share that round's
noise) as median and range;
exposed communication (median step minus compute-only median: the time synchronising
adds to the step, over what the compute hides of it); all-reduces per step; with
several micro-batches per step, the time per micro-batch.

Sweeps. `--sweep bucket_cap_mb=1e-6,1,25,1e6` (or accumulation_steps, batch_size,
global_batch_size) builds every variant once per value and interleaves all of them in
the same rounds, so the curve is not bent by the machine's mood; each value has its own
bound. compute_only and communication_alone run once for all values where the swept
field does not change them (DEPENDS_ON), and so do the variants that choose their own
buckets (torch_ddp_default, drop_in_default, drop_in_auto) in a bucket_cap_mb sweep. The
markdown adds a summary table, one row per value. `python -m profiling.bench.versus
FILE.json` compares one variant with another and with the best value of a sweep, per
workload, from results already written.

Outputs: the table on stdout; --json and --markdown write the same results, --plot a PNG
(one panel per workload: bars, or the sweep's curve). With --merge, the workloads already
in the --json file are kept (this run replaces its own workload) and --markdown and
--plot render all of them, the markdown's first line naming the commands that produced
them. The markdown is a fragment the docs include under a heading. `--render FILE.json`
runs nothing and redraws --markdown and --plot from results already written.

Every option of `ddp.config.Config` applies (--model, --batch-size, --bucket-cap-mb,
...), except that --steps counts timed steps per variant per round and --profile-dir is
refused (tracing would time itself).

The package, in the order a run goes through it: `options` (the command line, the
variant names, sweeps), `launch` (torchrun, on loopback or a shaped cluster),
`variants` (building and stepping each contender), `rounds` (the interleaved rounds on
every rank), `records` (the JSON record: bounds, ratios, machine), `output` (the table,
the markdown, the files), `plot` (the PNG) and, apart, `versus` (a comparison of
results already written).
"""
