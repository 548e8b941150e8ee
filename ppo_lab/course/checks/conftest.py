"""The grader's pytest plugin: it records each graded check's outcome and a message that says
what went wrong, for `ppo_lab.course.grader` (or for a student running `python -m pytest tests`).

Results are appended to PPO_LAB_COURSE_RESULTS one JSON line at a time as the checks run: the
collected items first, then each item's outcome. So when a submission hangs or kills the process,
the checks that finished before keep their marks, and the grader knows which did not finish.

It also makes sure that the package under test is the submission's copy of ppo_lab: the folder
above tests/ (or PPO_LAB_COURSE_SUBMISSION), never an installed one.
"""

import json
import os
import sys
import traceback
from pathlib import Path

import pytest

SUBMISSION = Path(os.environ.get("PPO_LAB_COURSE_SUBMISSION", Path(__file__).resolve().parents[1])).resolve()
if str(SUBMISSION) not in sys.path:
    sys.path.insert(0, str(SUBMISSION))


@pytest.fixture
def reference_last(monkeypatch):
    """Assignment 'shaping': shape_rewards' helper replaced by a correct one while a check of
    shape_rewards runs, so that a wrong last_real_index costs only its own marks."""
    import torch

    def last_real_index(mask):
        return torch.tensor([max(t for t in range(mask.shape[1]) if mask[b, t] > 0) for b in range(mask.shape[0])])

    from _grading import lab

    monkeypatch.setattr(lab("shaping"), "last_real_index", last_real_index)


def _record(entry: dict) -> None:
    out = os.environ.get("PPO_LAB_COURSE_RESULTS")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()


def _message(call) -> str:
    """One readable line or paragraph: the check's own message, or the student's exception and
    where it was raised (the last frame inside the submission)."""
    exc = call.excinfo.value
    if isinstance(exc, NotImplementedError):
        return f"NotImplementedError: {exc}"
    if call.excinfo.typename in ("Failed", "AssertionError") and str(exc):
        return str(exc).split("\nassert ")[0].strip()
    frames = [f for f in traceback.extract_tb(call.excinfo.tb) if str(SUBMISSION) in str(Path(f.filename).resolve())]
    where = f" (at {Path(frames[-1].filename).resolve().relative_to(SUBMISSION)}, line {frames[-1].lineno}: {frames[-1].line})" if frames else ""
    return f"{call.excinfo.typename}: {exc}{where}"


def pytest_collection_finish(session):
    for item in session.items:
        if getattr(getattr(item, "function", None), "graded", None) is not None:
            _record({"collected": item.nodeid, "test": item.originalname})


def pytest_collectreport(report):
    if report.failed:
        _record({"collect_error": str(report.longrepr)[-2000:]})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if getattr(item.function, "graded", None) is None:
        return
    if report.failed or (report.skipped and report.when != "teardown"):
        _record({"item": item.nodeid, "test": item.originalname, "passed": False,
                 "message": _message(call) if call.excinfo is not None and not report.skipped else "skipped"})
    elif report.when == "call":
        _record({"item": item.nodeid, "test": item.originalname, "passed": True})
