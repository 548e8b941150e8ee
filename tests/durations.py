"""Per-file time of the unit tests, from a `pytest --durations=0` report, so that a slow test is seen.

    python -m pytest -n 2 --dist loadfile -p no:cacheprovider --durations=0 > report.txt
    python tests/durations.py report.txt > tests/DURATIONS.md

Each file's total is the sum of its tests' setup, call and teardown times as pytest reports them
(durations under 5 ms are not reported, and count as 0), on the two workers `make test` uses, so
the totals add up to about twice the wall time. Not a test file: pytest does not collect it.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

LINE = re.compile(r"^(\d+\.\d+)s (setup|call|teardown)\s+(tests/[\w/]+\.py)::(\S+)")


def summary(report: str) -> str:
    total: dict[str, float] = defaultdict(float)
    slowest: dict[str, tuple[float, str]] = {}
    tests: dict[str, set] = defaultdict(set)
    for line in report.splitlines():
        m = LINE.match(line.strip())
        if not m:
            continue
        seconds, _, path, name = float(m[1]), m[2], m[3], m[4]
        total[path] += seconds
        tests[path].add(name)
        if seconds > slowest.get(path, (0.0, ""))[0]:
            slowest[path] = (seconds, name)
    outcome = re.search(r"^=*\s*((?:\d+ \w+, )*\d+ \w+) in ([\d.]+)s", report, re.M)
    rows = [
        "# Unit-test time per file",
        "",
        "Written by `python tests/durations.py` from a `pytest --durations=0` report of the unit tests"
        + (f" ({outcome[1]} in {float(outcome[2]):.0f} s of wall time, two workers)." if outcome else "."),
        "Seconds summed over each file's tests (setup, call, teardown); the slowest single phase beside it.",
        "",
        "| file | seconds | tests timed | slowest |",
        "|---|---:|---:|---|",
    ]
    for path in sorted(total, key=total.get, reverse=True):
        seconds, name = slowest[path]
        rows.append(f"| `{path}` | {total[path]:.1f} | {len(tests[path])} | {seconds:.1f} s `{name}` |")
    rows.append(f"| all | {sum(total.values()):.1f} | {sum(len(v) for v in tests.values())} | |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(summary(open(sys.argv[1]).read()))
