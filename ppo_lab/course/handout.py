"""A student's starting folder for one assignment, and its handout.

The folder holds everything a student needs, offline:

    README.md          the handout: what to write, the specification (the functions' docstrings),
                       the properties the grader checks and their marks, how to check
    ppo_lab/           the whole package, with this assignment's solution regions cut out
    tests/             the public checks (and the grader's conftest and helpers)
    assignment.json    which assignment this is, for the grader

Every other part of the package is complete, so a student's function runs inside the real
trainer as soon as it is written.
"""

from __future__ import annotations

import ast
import inspect
import json
import shutil
from importlib import import_module
from pathlib import Path

from .regions import regions_in_package, skeleton

PACKAGE = Path(__file__).resolve().parents[1]  # the installed ppo_lab: the reference solution
CHECKS = Path(__file__).resolve().parent / "checks"
SUPPORT = ("conftest.py", "_grading.py")  # copied beside the check files wherever they run


def check_files(name: str, hidden: bool = True) -> list[Path]:
    """The check files of an assignment: the public one, then (with `hidden`) the hidden one."""
    files = [CHECKS / f"test_{name}_public.py"] + ([CHECKS / f"test_{name}_hidden.py"] if hidden else [])
    for path in files:
        if not path.exists():
            raise FileNotFoundError(f"the course's check file {path} is missing from this installation of ppo_lab")
    return files


def properties(path: Path) -> list[dict]:
    """The graded checks of a check file, read without importing it (no torch needed): each test
    function decorated `@graded(function, points)`, with the property (its docstring's first line)."""
    found = []
    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, UnicodeDecodeError) as err:
        raise ValueError(f"the check file {path} cannot be read: {type(err).__name__}: {err}") from None
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "graded":
                function, points = (ast.literal_eval(a) for a in deco.args[:2])
                doc = (ast.get_docstring(node) or node.name).strip().split("\n")[0]
                found.append({"test": node.name, "function": function, "points": points, "property": doc,
                              "visibility": "hidden" if path.stem.endswith("_hidden") else "public"})
    return found


def create(assignment, folder, *, solution: bool = False) -> Path:
    """Write `assignment`'s starting folder at `folder` (which must not exist or be empty, so that
    nothing is overwritten). `solution=True` writes the reference package instead of the skeleton,
    for checking the grader. Returns the folder."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{folder} exists and is not an empty folder; give a new one (nothing there is overwritten)")
    cut = _cut_functions(assignment)
    missing = [f for f in (fn for _, fn in assignment.functions) if f not in cut]
    if missing:
        raise ValueError(f"assignment {assignment.name!r}: no solution region in {missing} (see ppo_lab/course/regions.py)")
    folder.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "course")
    shutil.copytree(PACKAGE, folder / "ppo_lab", ignore=ignore)
    if not solution:
        for path in sorted((folder / "ppo_lab").rglob("*.py")):
            text = path.read_text()
            if "### BEGIN SOLUTION" in text:
                path.write_text(skeleton(text, assignment.name, str(path)))
    (folder / "tests").mkdir()
    for path in [CHECKS / s for s in SUPPORT] + check_files(assignment.name, hidden=False):
        shutil.copy(path, folder / "tests" / path.name)
    (folder / "README.md").write_text(handout(assignment))
    from .. import __version__

    info = {"assignment": assignment.name, "ppo_lab": __version__, "solution": solution}
    (folder / "assignment.json").write_text(json.dumps(info, indent=2) + "\n")
    return folder


def _cut_functions(assignment) -> set[str]:
    """The names of the functions that hold one of `assignment`'s regions."""
    return {r.function for regions in regions_in_package(PACKAGE).values() for r in regions if r.assignment == assignment.name}


def specification(fn) -> str:
    """A function's source up to the end of its docstring: its signature and what it must do."""
    source = inspect.getsource(fn)
    docstring = ast.parse(source).body[0].body[0]
    return "\n".join(source.split("\n")[: docstring.end_lineno])


def handout(assignment) -> str:
    """The assignment's README.md: task, specification, graded properties, how to check."""
    rows = [p for f in check_files(assignment.name) for p in properties(f)]
    public = [p for p in rows if p["visibility"] == "public"]
    hidden = [p for p in rows if p["visibility"] == "hidden"]
    total = sum(p["points"] for p in rows)
    out = [
        f"# Assignment: {assignment.title}",
        "",
        f"Read {assignment.reading} of the PPO Lab book first.",
        f"This assignment teaches {assignment.teaches}.",
        f"Expected time: {assignment.hours} hours.",
        "",
        "## What to write",
        "",
        "`ppo_lab/` in this folder is the whole PPO Lab package, complete except for the functions",
        "below: each raises `NotImplementedError` where your code goes (a comment there lists the",
        "names that the rest of the function uses). Everything else in the package works, and you",
        "may call it. The docstrings are the specification.",
        "",
    ]
    for module, name in assignment.functions:
        out += [f"### `{module}.{name}`", "", "```python", specification(getattr(import_module(module), name)), "```", ""]
    out += [
        "## How it is graded",
        "",
        f"Each check tests one property of one function and is worth the marks shown; {total} in all.",
        "The public checks are in `tests/`; the grader also runs hidden ones.",
        "",
        "| function | property | marks |",
        "|---|---|---|",
        *(f"| `{p['function']}` | {p['property']} | {p['points']} |" for p in public),
        f"| (hidden checks) | {len(hidden)} more properties | {sum(p['points'] for p in hidden)} |",
        "",
        "## Checking your work",
        "",
        "You need Python 3.10 or newer with PyTorch and pytest. From this folder:",
        "",
        "```bash",
        "python -m pytest tests                   # the public checks",
        "ppo-lab-course grade . --public-only     # the same, with your score and what failed (needs ppo-lab installed)",
        "```",
        "",
        "Both run your copy of the package in `ppo_lab/`, not an installed one. So does",
        "`python -m ppo_lab.cli train` run in this folder (it needs the package's dependencies:",
        "transformers, accelerate, ...): it trains the built-in tiny model, with your functions where",
        "the trainer uses them.",
        "",
    ]
    return "\n".join(out)
