"""The offline autograder: run an assignment's checks against a student's folder, score them.

The checks are plain pytest files (`checks/`): each graded test checks one property of one
function and is worth a number of marks, all or nothing. `grade` runs them in a fresh Python
process whose `ppo_lab` is the folder's copy (so a crash, an endless loop or a broken import in
the student's code cannot take the grader down), then writes the report:

- on the terminal, one line per property with its marks and, when it failed, why;
- as JSON in Gradescope's results.json format (`score`, `execution_time`, `tests` with `name`,
  `score`, `max_score`, `output`, `visibility`, `tags`), with each function's score and the
  assignment under `extra_data`, so the same file serves a script and Gradescope.

Hidden checks are graded like the public ones; in the Gradescope report they are visible
`after_published`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import assignment as find_assignment
from .handout import CHECKS, SUPPORT, check_files, properties


def grade(folder, *, name: str | None = None, public_only: bool = False, timeout: float = 600.0) -> dict:
    """Grade the submission in `folder` (made by `create`: `ppo_lab/` and `assignment.json`).

    Args:
        folder: the student's folder.
        name: the assignment; None reads it from the folder's assignment.json.
        public_only: run only the public checks (what a student can run).
        timeout: seconds before the checks are stopped; every check not finished scores 0.

    Returns:
        the report, in Gradescope's results.json format (see the module docstring).
    """
    folder = Path(folder).resolve()
    if not (folder / "ppo_lab" / "__init__.py").exists():
        raise ValueError(f"{folder} holds no ppo_lab/ package; give the folder that `ppo-lab-course create` made")
    if name is None:
        info = folder / "assignment.json"
        if not info.exists():
            raise ValueError(f"{folder} has no assignment.json; name the assignment (--assignment)")
        name = json.loads(info.read_text())["assignment"]
    spec = find_assignment(name)
    files = check_files(spec.name, hidden=not public_only)
    expected = [p for f in files for p in properties(f)]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ppo-lab-grade-") as tmp:
        run = Path(tmp)
        for path in [CHECKS / s for s in SUPPORT] + files:
            shutil.copy(path, run / path.name)
        (run / "pytest.ini").write_text("[pytest]\n")  # this folder is the rootdir: no outer config applies
        results = run / "results.json"
        env = {**os.environ, "PPO_LAB_COURSE_SUBMISSION": str(folder), "PPO_LAB_COURSE_RESULTS": str(results),
               "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [sys.executable, "-m", "pytest", str(run), "-q", "-p", "no:cacheprovider", "--rootdir", str(run), "-c", str(run / "pytest.ini")]
        try:
            proc = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True, timeout=timeout)
            problem = None if results.exists() else f"the checks did not run: {(proc.stdout + proc.stderr).strip()[-2000:]}"
        except subprocess.TimeoutExpired:
            problem = f"the checks did not finish in {timeout:g} s (an endless loop?)"
        ran = {r["test"]: r for r in json.loads(results.read_text())} if results.exists() else {}
    tests = []
    for p in expected:
        r = ran.get(p["test"])
        passed = bool(r and r["passed"])
        output = "" if passed else (r["message"] if r else (problem or "this check did not run"))
        tests.append({
            "name": f"{p['function']}: {p['property']}",
            "score": p["points"] if passed else 0,
            "max_score": p["points"],
            "output": output,
            "visibility": "visible" if p["visibility"] == "public" else "after_published",
            "tags": [p["function"], p["visibility"]],
        })
    functions: dict[str, dict[str, float]] = {}
    for t in tests:
        f = functions.setdefault(t["tags"][0], {"score": 0, "max_score": 0})
        f["score"] += t["score"]
        f["max_score"] += t["max_score"]
    return {
        "score": sum(t["score"] for t in tests),
        "execution_time": round(time.perf_counter() - start, 2),
        "output": f"assignment {spec.name}: {sum(t['score'] for t in tests)} of {sum(t['max_score'] for t in tests)} marks",
        "visibility": "visible",
        "tests": tests,
        "extra_data": {"assignment": spec.name, "max_score": sum(t["max_score"] for t in tests), "functions": functions,
                       "public_only": public_only},
    }


def summary(report: dict) -> str:
    """The report as text: a line per property (marks, public/hidden, why it failed), then the
    score of each function and the total."""
    lines = []
    for t in report["tests"]:
        mark = "ok  " if t["score"] == t["max_score"] else "FAIL"
        lines.append(f"{mark} {t['score']:g}/{t['max_score']:g}  [{t['tags'][1]}] {t['name']}")
        if t["output"]:
            lines += [f"           {line}" for line in t["output"].split("\n")]
    lines.append("")
    for name, f in report["extra_data"]["functions"].items():
        lines.append(f"{name}: {f['score']:g} of {f['max_score']:g}")
    lines.append(f"{report['output']} ({report['execution_time']:.1f} s)")
    return "\n".join(lines)
