"""Solution regions: the parts of `ppo_lab`'s own source that a course's students write.

A region is marked in the package's source with nbgrader's delimiters, named after its
assignment::

    def compute_gae(rewards, values, mask, gamma, lam):
        ...argument checks, kept...
        ### BEGIN SOLUTION gae
        ...the code the student writes...
        ### END SOLUTION

The markers are comments, so the package runs and is tested as it is: the reference solution is
the tested package. `skeleton` turns a file into its student version: each region of the chosen
assignment becomes a `raise NotImplementedError` that names the function, after a comment listing
the names that the rest of the function uses (so that the student knows what to define); the
markers of every other assignment are dropped and their code kept.

Written by hand, not with nbgrader or otter-grader: both strip solutions from notebook cells,
and these regions live in a Python package's modules.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION(?: (?P<name>\w+))?\s*$")
END = re.compile(r"^\s*### END SOLUTION\s*$")
_DEF = re.compile(r"^(?P<indent>\s*)(?:async\s+)?def (?P<name>\w+)\s*\(")
# `a = ...`, `a, b = ...`, `a += ...`, `a: int = ...` (a keyword argument `a=b,` of a call that
# continues over several lines is not an assignment: lines ending in "," are skipped)
_ASSIGNED = re.compile(r"^\s*(?P<targets>[A-Za-z_][\w, ]*?)\s*(?::[^=]+)?(?:\+|-|\*|/|//|\*\*|%|\||&|\^)?=(?!=)")


@dataclass(frozen=True)
class Region:
    """One solution region: its assignment, the function it sits in, its lines (0-based: the
    BEGIN marker's and the END marker's)."""

    assignment: str
    function: str
    begin: int
    end: int
    indent: str


def find_regions(text: str, where: str = "<source>") -> list[Region]:
    """Every solution region of a file's text, checked: each BEGIN has a name and an END, none is
    nested, each sits inside a function. A malformed one raises ValueError naming `where`:line."""
    regions, lines, open_at = [], text.split("\n"), None
    for i, line in enumerate(lines):
        if BEGIN.match(line):
            if open_at is not None:
                raise ValueError(f"{where}:{i + 1}: a solution region opens inside the one opened at line {open_at + 1}")
            if not BEGIN.match(line).group("name"):
                raise ValueError(f"{where}:{i + 1}: '### BEGIN SOLUTION' needs the assignment's name after it")
            open_at = i
        elif END.match(line):
            if open_at is None:
                raise ValueError(f"{where}:{i + 1}: '### END SOLUTION' without a BEGIN before it")
            begin = BEGIN.match(lines[open_at])
            function = _enclosing_function(lines, open_at)
            if function is None:
                raise ValueError(f"{where}:{open_at + 1}: a solution region must sit inside a function")
            regions.append(Region(begin.group("name"), function, open_at, i, begin.group("indent")))
            open_at = None
    if open_at is not None:
        raise ValueError(f"{where}:{open_at + 1}: '### BEGIN SOLUTION' without an END")
    return regions


def _enclosing_function(lines: list[str], at: int) -> str | None:
    indent = len(lines[at]) - len(lines[at].lstrip())
    for line in reversed(lines[:at]):
        m = _DEF.match(line)
        if m and len(m.group("indent")) < indent:
            return m.group("name")
    return None


def _function_rest(lines: list[str], region: Region) -> list[str]:
    """The lines of the region's function after its END marker (to the end of the function, not
    of the block the region sits in)."""
    def_indent = next(len(m.group("indent")) for line in reversed(lines[: region.begin])
                      if (m := _DEF.match(line)) and len(m.group("indent")) < len(region.indent))
    rest = []
    for line in lines[region.end + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= def_indent:
            break
        rest.append(line)
    return rest


def names_used_later(lines: list[str], region: Region) -> list[str]:
    """The names a region assigns that the rest of its function reads, in order of assignment."""
    assigned = []
    for line in lines[region.begin + 1 : region.end]:
        m = _ASSIGNED.match(line)
        if m and not line.rstrip().endswith(","):
            for name in (t.strip() for t in m.group("targets").split(",")):
                if name.isidentifier() and not keyword.iskeyword(name) and name not in assigned:
                    assigned.append(name)
    code = (re.sub(r"(\"[^\"]*\"|'[^']*')", "", line.split("#")[0]) for line in _function_rest(lines, region))
    later = {w for line in code for w in re.findall(r"(?<![\w.])[A-Za-z_]\w*", line)}  # names, not attributes or strings
    return [name for name in assigned if name in later]


def skeleton(text: str, assignment: str | Collection[str], where: str = "<source>") -> str:
    """The student's version of a file: the regions of `assignment` (a name, or several) replaced
    by a NotImplementedError, the markers of the other assignments' regions removed (their code
    kept). The student edition of the book cuts every assignment at once."""
    wanted = {assignment} if isinstance(assignment, str) else set(assignment)
    lines = text.split("\n")
    cut = {r.begin: r for r in find_regions(text, where)}
    out = []
    i = 0
    while i < len(lines):
        region = cut.get(i)
        if region is None:
            if not END.match(lines[i]):
                out.append(lines[i])
            i += 1
            continue
        if region.assignment in wanted:
            later, name = names_used_later(lines, region), region.assignment
            out.append(f"{region.indent}# Assignment '{name}': write this part of {region.function}.")
            if later:
                out.append(f"{region.indent}# The rest of the function uses: {', '.join(later)}.")
            out.append(f'{region.indent}raise NotImplementedError("{region.function}: not written yet (assignment \'{name}\')")')
            i = region.end + 1
        else:
            i += 1  # drop the BEGIN marker, keep the code; the END marker is dropped above
    return "\n".join(out)


def regions_in_package(root: Path) -> dict[str, list[Region]]:
    """{relative path: its regions} for every .py file under `root` that has any."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        if "course" in path.relative_to(root).parts:  # the course's own code (its docstrings show markers)
            continue
        regions = find_regions(path.read_text(), str(path))
        if regions:
            found[path.relative_to(root).as_posix()] = regions
    return found
