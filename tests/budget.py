"""The suite's time budget, read from pytest's own record of a run (its JUnit XML: `make test
PYTEST_ARGS=--junitxml=FILE`), never timed inside a test:

    python -m tests.budget FILE [--suite test|test-faults] [--budget-s S]

prints the run's wall time against the budget and its 15 slowest tests (setup, call and teardown together, as the
XML's `time` holds them), and exits 1 when the wall time exceeds the budget by more than 20% (or when the XML
records no run). BUDGET_S is what `make test` takes on the CI machine (2 cores, 24 GiB, no GPU) with room for its
noise; 1.2 x BUDGET_S is the 15 minutes the project allows itself. `make test-faults` (the fault-injection modules)
has a budget of its own (BUDGETS). CI runs it after each.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET

BUDGET_S = 750.0  # make test's pytest run on the CI machine: 12.5 minutes
BUDGETS = {"test": BUDGET_S, "test-faults": 660.0}  # each make target's; test-faults: the fault-injection modules
OVER = 1.2  # the check fails above OVER x the budget
SLOWEST = 15


def read(path: str) -> tuple[float, list[tuple[float, str]]]:
    """A JUnit XML file -> (the run's wall seconds, [(seconds, test id)] of every test case that ran, not
    skipped)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise ValueError(f"{path}: no <testsuite> element: not pytest's JUnit XML")
    wall = sum(float(s.get("time", 0.0)) for s in suites)
    cases = [
        (float(c.get("time", 0.0)), f"{c.get('classname')}::{c.get('name')}")
        for s in suites
        for c in s.iter("testcase")
        if c.find("skipped") is None  # a run of skipped tests ran nothing
    ]
    return wall, cases


def verdict(wall: float, cases: list[tuple[float, str]], budget_s: float, suite: str = "test") -> tuple[bool, str]:
    """(within OVER x budget, the report: the wall time against the budget, then the SLOWEST slowest tests)."""
    limit = OVER * budget_s
    ok = bool(cases) and wall <= limit
    lines = [
        f"make {suite}: {len(cases)} tests in {wall / 60:.1f} min (wall); budget {budget_s / 60:.1f} min, "
        f"limit {limit / 60:.1f} min (+{OVER - 1:.0%}): {'within' if ok else 'OVER' if cases else 'NO TESTS RECORDED'}",
        f"the {min(SLOWEST, len(cases))} slowest (seconds, setup + call + teardown):",
    ]
    lines += [f"  {s:7.1f}  {name}" for s, name in sorted(cases, reverse=True)[:SLOWEST]]
    return ok, "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.budget", description=__doc__.split("\n\n")[0])
    p.add_argument("junit_xml")
    p.add_argument("--suite", choices=sorted(BUDGETS), default="test", help="the make target the XML records")
    p.add_argument("--budget-s", type=float, help="the budget (default: the suite's, BUDGETS)")
    args = p.parse_args(argv)
    try:
        wall, cases = read(args.junit_xml)
    except (OSError, ET.ParseError, ValueError) as e:
        print(f"error: {args.junit_xml}: {e}", file=sys.stderr)
        return 2
    ok, report = verdict(wall, cases, BUDGETS[args.suite] if args.budget_s is None else args.budget_s, args.suite)
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
