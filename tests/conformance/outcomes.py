"""Compare two runs of torch's DDP tests (junit XML): torch's own DDP, and the drop-in.

    python -m tests.conformance.outcomes runs/conformance/torch.xml runs/conformance/ours.xml

Prints the counts and every test whose outcome differs, and exits 1 if a test that
passes with torch's DDP fails with ours, unless it is listed in INTERNALS (tests that
inspect torch's implementation rather than what a user sees)."""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter

# --8<-- [start:internals]
# Tests that inspect torch's implementation rather than what a user sees, each with why
# the drop-in cannot pass it. None now: the two that read the logging data pass.
INTERNALS: dict[str, str] = {}
# --8<-- [end:internals]


def outcomes(path: str) -> dict[str, str]:
    """test name -> passed | failed | skipped, from a pytest junit XML file."""
    result = {}
    for case in ET.parse(path).iter("testcase"):
        kinds = {child.tag for child in case}
        result[case.get("name")] = (
            "failed"
            if kinds & {"failure", "error"}
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.conformance.outcomes", description=__doc__.splitlines()[0]
    )
    parser.add_argument("torch_xml", help="junit XML of the run with torch's DDP")
    parser.add_argument("ours_xml", help="junit XML of the run with the drop-in")
    args = parser.parse_args(argv)
    torch_xml, ours_xml = args.torch_xml, args.ours_xml
    theirs, ours = outcomes(torch_xml), outcomes(ours_xml)
    print(f"torch's DDP: {dict(Counter(theirs.values()))}")
    print(f"drop-in:     {dict(Counter(ours.values()))}")
    regressions = []
    for name in sorted(theirs):
        if theirs[name] != ours.get(name):
            note = f"  ({INTERNALS[name]})" if name in INTERNALS else ""
            print(f"{name}: torch's {theirs[name]}, ours {ours.get(name)}{note}")
            if theirs[name] == "passed" and name not in INTERNALS:
                regressions.append(name)
    public = [n for n, o in theirs.items() if o == "passed" and n not in INTERNALS]
    passed = [n for n in public if ours.get(n) == "passed"]
    print(f"public-behaviour tests torch's DDP passes: {len(public)}; ours passes {len(passed)}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
