"""Which method of which stage runs at each point of one gradient's path through the final
class, traced from the code: the table on the page "One gradient through the final class".

    python -m profiling.course.backward_path              # the table, as the page shows it
    python -m profiling.course.backward_path --functions  # and the backward's functions

One warm synchronised step of the drop-in (the last of `stages.STAGES`) with default
options, on a 1-rank Gloo group made in this process (an in-memory store: no port, no
file) and destroyed after: its forward and backward run under `sys.setprofile`, which
records every call into the project's code (`stages/`, `ddp/`) with the project call it
came from. Calls are read as chains: a method and the `super()` calls it makes of the
same name, so `_finish_backward` is one row, drop_in -> unused_params -> missing_grads ->
overlapped, the first running first and calling the next. The docs build (`docs/hooks.py`, the
`{{ backward_path() }}` placeholder) renders the table from a fresh trace every time, so
it cannot name fewer methods than run; tests/test_final_class_doc.py checks that it names
every one.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import stages

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("stages", "ddp")  # the folders whose code the trace records
# Code objects of their own that are no function a reader calls by name.
ANONYMOUS = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>"}
# The first backward records the ready order, the next forward rebuilds the buckets in
# it (stage rebuilt_buckets); the first 10 steps have their times recorded, as torch's
# logging data does (then one in 100), so the step after those runs as most steps do.
WARM_STEPS = 11
WIDTH, LAYERS = 256, 6  # 6 x Linear(256, 256): 12 gradients, 1.5 MiB, so two buckets
# The point of one gradient's path each chain starts, by its method (a key the trace does
# not meet is an error: the page's words would name a method that no longer runs).
POINTS = {
    "_prepare_for_backward": "forward, once per step",
    "on_ready": "**a gradient is ready**, once per gradient",
    "_start_backward": "the first gradient, once per step",
    "_launch_ready_buckets": "a bucket is complete, once per bucket",
    "_finish_backward": "the end of backward, once per step",
}
FORWARD_ENTRY = "_prepare_for_backward"  # what forward does for the backward after it
HEADER = "| when | what runs, in call order |"


@dataclass(frozen=True)
class Call:
    """One call into the project's code."""

    qualname: str  # the code object's: "OverlappedDDP._send", "_gradient_hook.<locals>.on_ready"
    path: str  # its file, from the repository root
    parent: int | None  # the project call it came from (in Trace.calls); None: from torch
    backward: bool  # made during loss.backward(), else during the forward before it

    @property
    def method(self) -> str:
        return self.qualname.rpartition(".")[2]

    @property
    def owner(self) -> str:
        """The class that defines it, or for a plain function (a closure too) its file."""
        scope = self.qualname.rpartition(".")[0]
        if not scope or scope.endswith("<locals>"):
            return self.path
        return scope.rpartition("<locals>.")[2]  # a class made inside a function

    @property
    def function(self) -> str:
        return f"{self.path}:{self.qualname}"


@dataclass
class Trace:
    """Every project call of one traced step, in the order they were made."""

    calls: list[Call]
    gradients: int  # parameters that got a gradient
    buckets: int
    stage_of: dict[str, str]  # stage class name -> stage name ("OverlappedDDP": "overlapped")
    classes: list[str]  # the wrapper's classes in the project, itself first

    def shown(self) -> list[Call]:
        """The calls the table shows: the backward's, and forward's `_prepare_for_backward`
        with all it calls."""
        inside: set[int] = set()
        for i, call in enumerate(self.calls):
            if call.backward:
                inside.add(i)
            elif call.parent in inside or (call.method == FORWARD_ENTRY and not inside):
                inside.add(i)
        return [self.calls[i] for i in sorted(inside)]


def backward_functions(trace: Trace) -> list[str]:
    """The distinct functions of the project that the traced backward ran ("path:qualname",
    comprehensions and lambdas aside), in the order each first ran: how much code a reader
    follows for one backward."""
    return list(dict.fromkeys(c.function for c in trace.calls if c.backward))


@contextmanager
def one_rank_group() -> Iterator[dist.ProcessGroup]:
    """A Gloo group of this process alone, on an in-memory store, destroyed on leaving."""
    if dist.is_initialized():
        raise RuntimeError(
            "backward_path: this process already has a default process group; pass it "
            "(or a 1-rank subgroup of it) to trace() as `group`"
        )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def trace(
    wrapper: type[nn.Module] | None = None,
    group: dist.ProcessGroup | None = None,
    stage_classes: dict[str, type] | None = None,
) -> Trace:
    """One warm synchronised step of `wrapper` (the drop-in) with default options, traced.
    Without `group`, on a 1-rank group of this process (which must have none yet)."""
    stage_classes = stages.STAGES if stage_classes is None else stage_classes
    wrapper = list(stage_classes.values())[-1] if wrapper is None else wrapper
    if group is None:
        with one_rank_group() as own:
            return trace(wrapper, own, stage_classes)
    threads = torch.get_num_threads()
    # The ops are tiny: a second thread only waits for a core, and on a busy machine that
    # made the docs build's trace take seconds instead of a fifth of one.
    torch.set_num_threads(1)
    try:
        return _traced_step(wrapper, group, stage_classes)
    finally:
        torch.set_num_threads(threads)


def _traced_step(wrapper: type[nn.Module], group, stage_classes: dict[str, type]) -> Trace:
    first = next(iter(stage_classes.values()))
    classes = [c for c in wrapper.__mro__ if issubclass(c, first)]
    # The project's folders, and the file of any subclass outside them (a test's).
    files = tuple(f"{ROOT / part}/" for part in PROJECT) + tuple(
        sys.modules[c.__module__].__file__ for c in classes
    )
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    ddp = wrapper(model, process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    for _ in range(WARM_STEPS):
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    calls: list[Call] = []
    running: dict[int, int] = {}  # id of a project call's frame, while it runs -> its index
    in_backward = False

    def record(frame, event: str, arg) -> None:
        if event == "return":
            running.pop(id(frame), None)
            return
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(files) or code.co_name in ANONYMOUS:
            return
        caller = frame.f_back  # the nearest project call up the stack, past torch's frames
        while caller is not None and id(caller) not in running:
            caller = caller.f_back
        running[id(frame)] = len(calls)
        path = Path(code.co_filename).resolve()
        where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        parent = None if caller is None else running[id(caller)]
        calls.append(Call(code.co_qualname, where, parent, in_backward))

    sys.setprofile(record)
    try:
        loss = nn.functional.mse_loss(ddp(x), y)
        in_backward = True
        loss.backward()
    finally:
        sys.setprofile(None)
        running.clear()  # frame ids only; no frame outlives the step
    return Trace(
        calls=calls,
        gradients=sum(p.grad is not None for p in model.parameters()),
        buckets=len(ddp.buckets),
        stage_of={cls.__name__: name for name, cls in stage_classes.items()},
        classes=[c.__name__ for c in classes],
    )


@dataclass
class Node:
    """One row: a chain of calls (a method and its `super()` calls), merged over every time
    the same chain ran from the same place."""

    chain: list[Call]
    caller: Call | None  # the member of the parent's chain that called it, if it has several
    calls: int = 0
    children: dict[tuple, Node] = field(default_factory=dict)


def _tree(trace: Trace, roots: list[int], children: dict[int, list[int]]) -> dict[tuple, Node]:
    calls = trace.calls

    def chain_of(i: int) -> list[int]:
        chain = [i]
        while True:
            up = next((j for j in children[chain[-1]] if calls[j].method == calls[i].method
                       and calls[j].owner != calls[chain[-1]].owner), None)  # fmt: skip
            if up is None:
                return chain
            chain.append(up)

    def add(into: dict[tuple, Node], i: int, caller: int | None) -> None:
        chain = chain_of(i)
        by = None if caller is None else calls[caller]
        key = (None if by is None else by.qualname, *(calls[k].qualname for k in chain))
        node = into.setdefault(key, Node([calls[k] for k in chain], by))
        node.calls += 1
        # What the chain calls besides itself, in call order; "from" only where it is ambiguous.
        for j in sorted(j for k in chain for j in children[k] if j not in chain):
            add(node.children, j, calls[j].parent if len(chain) > 1 else None)

    tree: dict[tuple, Node] = {}
    for i in roots:
        add(tree, i, None)
    return tree


def _find(tree: dict[tuple, Node], method: str) -> Node | None:
    for node in tree.values():
        if node.chain[0].method == method:
            return node
        found = _find(node.children, method)
        if found is not None:
            return found
    return None


def table(trace: Trace, stage_link: str = "stages/{}.md") -> str:
    """The Markdown table: a row per point of the path, and in it a line per chain, in call
    order, a chain's callees indented under it; `stage_link` makes a stage's page from its
    name."""
    calls = trace.calls
    children: dict[int, list[int]] = defaultdict(list)
    for i, call in enumerate(calls):
        if call.parent is not None:
            children[call.parent].append(i)

    def from_torch(backward: bool) -> list[int]:  # what forward's caller or autograd called
        return [i for i, c in enumerate(calls) if c.parent is None and c.backward == backward]

    entry = _find(_tree(trace, from_torch(False), children), FORWARD_ENTRY)
    if entry is None:
        raise ValueError(f"backward_path: forward ran no {FORWARD_ENTRY}; rename FORWARD_ENTRY")
    roots = {("forward",): entry, **_tree(trace, from_torch(True), children)}
    met = {c.method for c in trace.shown()}
    if stale := [m for m in POINTS if m not in met]:
        raise ValueError(
            f"backward_path: POINTS names {stale}, which the traced step never ran; "
            "rename them to the methods that now start those points"
        )

    def name(owner: str) -> str:
        stage = trace.stage_of.get(owner)
        return f"`{owner}`" if stage is None else f"[{stage}]({stage_link.format(stage)})"

    points: list[tuple[str, list[str]]] = []  # (when, its lines)

    def walk(tree: dict[tuple, Node], under: int) -> None:
        for node in tree.values():
            head, depth = node.chain[0], under
            if depth == 0 or head.method in POINTS:  # a new point of the path
                points.append((POINTS.get(head.method, f"`{head.method}`"), []))
                depth = 0
            if head.owner in trace.classes:  # a stage's method: its chain of stages
                line = f"`{head.method}`"
                where = " → ".join(name(c.owner) for c in node.chain)
            else:  # a helper's: a plain function, or a class beside a stage
                line = f"`{head.qualname.rpartition('<locals>.')[2]}`"
                where = " → ".join(dict.fromkeys(f"`{c.path}`" for c in node.chain))
            if node.calls > 1:
                line += f" ×{node.calls}"
            if node.caller is not None:  # which stage of the chain above calls it
                by = trace.stage_of.get(node.caller.owner, node.caller.owner)
                line += f", from {by}" if depth else f", from {by}'s `{node.caller.method}`"
            indent = "&emsp;" * (depth - 1) + "↳ " if depth else ""
            points[-1][1].append(f"{indent}{line}: {where}")
            walk(node.children, depth + 1)

    walk(roots, 0)
    rows = [f"| {when} | {'<br>'.join(lines)} |" for when, lines in points]
    return "\n".join([HEADER, "|---|---|", *rows]) + "\n"


def page_text(trace: Trace, stage_link: str = "stages/{}.md") -> str:
    """What the page shows: the table, what was traced, and the backward's function count."""
    functions = backward_functions(trace)
    return (
        table(trace, stage_link)
        + f"\n*Traced at build time by `profiling/course/backward_path.py`: one warm "
        f"synchronised step of `{trace.classes[0]}` with default options on one rank, "
        f"{trace.gradients} gradients in {trace.buckets} buckets (×n: it ran n times in that "
        f"step). The backward runs {len(functions)} distinct functions of the project's own, "
        "each a line of the table or a stage in a line's chain.*\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m profiling.course.backward_path",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--functions", action="store_true", help="also list the backward's distinct functions"
    )
    args = parser.parse_args(argv)
    traced = trace()
    print(page_text(traced), end="")
    if args.functions:
        print()
        for function in backward_functions(traced):
            print(function)


if __name__ == "__main__":
    main()
