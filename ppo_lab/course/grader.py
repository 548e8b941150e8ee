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
`after_published`. An instructor's own checks (`extra_checks`, a folder of `test_*.py` files
written like those in `checks/`) run as hidden checks beside them and need not ship with the
package.
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


def grade(folder, *, name: str | None = None, public_only: bool = False, extra_checks=None, timeout: float = 600.0) -> dict:
    """Grade the submission in `folder` (made by `create`: `ppo_lab/` and `assignment.json`).

    Args:
        folder: the student's folder.
        name: the assignment; None reads it from the folder's assignment.json.
        public_only: run only the public checks (what a student can run).
        extra_checks: a folder of the instructor's own check files (`test_*.py`, written like
            those in `checks/`, with `@graded`), run as hidden checks beside the built-in ones.
        timeout: seconds before the checks are stopped; the checks that had finished keep their
            marks, the others score 0.

    Returns:
        the report, in Gradescope's results.json format (see the module docstring); its
        `extra_data["problem"]` says why some checks did not run, if any did not.
    """
    folder = Path(folder).resolve()
    if not (folder / "ppo_lab" / "__init__.py").exists():
        raise ValueError(f"{folder} holds no ppo_lab/ package; give the folder that `ppo-lab-course create` made")
    spec = find_assignment(name if name is not None else _assignment_of(folder))
    files = check_files(spec.name, hidden=not public_only)
    if extra_checks is not None and not public_only:
        extra = sorted(Path(extra_checks).glob("test_*.py"))
        if not extra:
            raise ValueError(f"{extra_checks} holds no check files (test_*.py)")
        files += extra
    expected = [{**p, **({"visibility": "hidden"} if f.parent != CHECKS else {})} for f in files for p in properties(f)]
    names = [p["test"] for p in expected]
    if len(set(names)) != len(names):
        raise ValueError(f"two checks share a name: {sorted({n for n in names if names.count(n) > 1})}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ppo-lab-grade-") as tmp:
        run = Path(tmp)
        for path in [CHECKS / s for s in SUPPORT] + files:
            shutil.copy(path, run / path.name)
        (run / "pytest.ini").write_text("[pytest]\n")  # this folder is the rootdir: no outer config applies
        results = run / "results.jsonl"
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
        env.update({
            "PPO_LAB_COURSE_SUBMISSION": str(folder), "PPO_LAB_COURSE_RESULTS": str(results),
            "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "OMP_NUM_THREADS": "1",
        })
        # the files in order, public first: the checks a student can see always run first
        cmd = [sys.executable, "-m", "pytest", *(str(run / f.name) for f in files), "-q", "-p", "no:cacheprovider", "--rootdir", str(run), "-c", str(run / "pytest.ini")]
        problem = None
        try:
            proc = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True, timeout=timeout)
            if proc.returncode not in (0, 1):  # 0: all passed, 1: some failed; else pytest itself failed
                problem = f"the checks did not run to the end (pytest exit code {proc.returncode}): {(proc.stdout + proc.stderr).strip()[-2000:]}"
        except subprocess.TimeoutExpired:
            problem = f"the checks did not finish in {timeout:g} s (an endless loop?)"
        lines = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    collect_errors = [r["collect_error"] for r in lines if "collect_error" in r]
    if collect_errors:
        problem = f"a check file could not be loaded: {collect_errors[0]}"
    tests = []
    for p in expected:
        items = {r["collected"] for r in lines if r.get("test") == p["test"] and "collected" in r}
        fails = [r["message"] for r in lines if r.get("test") == p["test"] and r.get("passed") is False]
        done = {r["item"] for r in lines if r.get("test") == p["test"] and "item" in r}
        passed = bool(items) and not fails and items <= done
        output = "" if passed else (fails[0] if fails else (problem or "this check did not run"))
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
                       "public_only": public_only, "problem": problem},
    }


def _assignment_of(folder: Path) -> str:
    """The assignment named in a folder's assignment.json, or a ValueError that says what is wrong."""
    info = folder / "assignment.json"
    try:
        return json.loads(info.read_text())["assignment"]
    except FileNotFoundError:
        raise ValueError(f"{folder} has no assignment.json; name the assignment (--assignment)") from None
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{info} is not an assignment file ({type(err).__name__}: {err}); name the assignment (--assignment)") from None


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
    if report["extra_data"].get("problem"):
        lines.append(f"problem: {report['extra_data']['problem']}")
    lines.append(f"{report['output']} ({report['execution_time']:.1f} s)")
    return "\n".join(lines)
