"""The `ppo-lab-course` command: list the assignments, create a student's folder, grade one.

    ppo-lab-course list
    ppo-lab-course create NAME FOLDER [--solution]
    ppo-lab-course grade FOLDER [--public-only] [--extra-checks DIR] [--json FILE] [--fail-under MARKS] [--timeout S]

`grade` exits 0 once the folder was graded, whatever the score (a course's CI can require a
minimum with --fail-under, which exits 1 below it), 2 for bad input (no such assignment, a
folder that is not a submission), with one line `ppo-lab-course: error: ...`, and 3 when the
checks could not run at all (pytest or torch missing, a check file that does not load).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import ASSIGNMENTS, create, grade
from .grader import summary
from .handout import check_files, properties


def _list() -> int:
    for i, a in enumerate(ASSIGNMENTS.values(), 1):
        marks = sum(p["points"] for f in check_files(a.name) for p in properties(f))
        functions = ", ".join(f for _, f in a.functions)
        print(f"{i}. {a.name:<11} {a.title} ({a.reading}; about {a.hours} h; {marks} marks)\n   writes: {functions}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ppo-lab-course", description="Course assignments built from ppo_lab, and their offline autograder.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the assignments, in the book's order")
    p = sub.add_parser("create", help="write a student's starting folder for an assignment")
    p.add_argument("name", help=f"one of: {', '.join(ASSIGNMENTS)}")
    p.add_argument("folder", type=Path, help="a new (or empty) folder")
    p.add_argument("--solution", action="store_true", help="write the reference solution instead of the skeleton")
    p = sub.add_parser("grade", help="grade a folder made by `create`")
    p.add_argument("folder", type=Path)
    p.add_argument("--assignment", help="the assignment (default: the folder's assignment.json)")
    p.add_argument("--public-only", action="store_true", help="run only the public checks")
    p.add_argument("--extra-checks", type=Path, help="a folder of your own check files (test_*.py), run as hidden checks too")
    p.add_argument("--json", type=Path, help="write the report here (Gradescope's results.json format)")
    p.add_argument("--fail-under", type=float, help="exit 1 if the score is below this many marks")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the checks are stopped (default 600)")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            return _list()
        if args.command == "create":
            folder = create(args.name, args.folder, solution=args.solution)
            print(f"wrote {folder}: read its README.md")
            return 0
        report = grade(args.folder, name=args.assignment, public_only=args.public_only, extra_checks=args.extra_checks, timeout=args.timeout)
    except (ValueError, FileNotFoundError) as err:
        print(f"ppo-lab-course: error: {err}", file=sys.stderr)
        return 2
    print(summary(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    problem = report["extra_data"]["problem"]
    if problem and not any(t["score"] for t in report["tests"]) and "did not finish in" not in problem:
        return 3  # the checks could not run at all: the grader's environment, not the submission
    if args.fail_under is not None and report["score"] < args.fail_under:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
