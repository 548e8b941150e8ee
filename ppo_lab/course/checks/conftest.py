"""The grader's pytest plugin: it records each graded check's outcome and a message that says
what went wrong, for `ppo_lab.course.grader` (or for a student running `python -m pytest tests`).

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
_RESULTS = {}


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    graded = getattr(item.function, "graded", None)
    if graded is None or (report.when != "call" and report.passed):
        return
    entry = _RESULTS.setdefault(item.nodeid.split("[")[0], {
        **graded, "file": Path(item.fspath).name, "test": item.originalname,
        "property": (item.function.__doc__ or item.originalname).strip().split("\n")[0], "passed": True, "message": "",
    })
    if report.failed or report.skipped:
        entry["passed"] = False
        if not entry["message"]:
            entry["message"] = _message(call) if call.excinfo is not None else "skipped"


def pytest_sessionfinish(session):
    out = os.environ.get("PPO_LAB_COURSE_RESULTS")
    if out:
        Path(out).write_text(json.dumps(list(_RESULTS.values()), indent=1))
