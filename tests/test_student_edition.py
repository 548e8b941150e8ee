"""The student edition (`make student-book`) builds with -W and holds no exercise or assignment solution.

book/_scripts/student_edition.py runs once, into a scratch folder (seconds: it executes nothing).
The solutions are read here from the .md sources with a parser of this file's own, so that a
mistake in the script's cutting cannot hide itself, and their distinctive lines are looked for in
every file the edition writes: the HTML pages, the files they serve, the student notebooks.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from bs4 import BeautifulSoup

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_scripts"))

import twins  # noqa: E402

from ppo_lab.course import ASSIGNMENTS  # noqa: E402
from ppo_lab.course.regions import regions_in_package, skeleton  # noqa: E402

CHAPTERS = twins.chapters()
# every executed page sets exercises but the opening page, which runs the whole loop once
EXERCISE_PAGES = [md for md in CHAPTERS if md.stem != "ppo_in_one_screen"]
# a directive's body ends at the first line holding its fence alone (nested code uses a shorter one)
BLOCK = r"^(?P<fence>`{{3,}}|:{{3,}})\{{{name}\}}[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$"
SOLUTION = re.compile(BLOCK.format(name="solution"), re.M | re.S)
EXERCISE = re.compile(BLOCK.format(name="exercise"), re.M | re.S)
HEADING = re.compile(r"^## +(.+?)\s*$", re.M)


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    proc = subprocess.run([sys.executable, str(ROOT / "book/_scripts/student_edition.py"), str(out)], capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    return out, log


def normal(text: str) -> str:
    return " ".join(text.split())


def cut(text: str) -> str:
    """Markdown without its solution blocks, blank lines collapsed as the script leaves them."""
    return re.sub(r"\n{3,}", "\n\n", SOLUTION.sub("", text)).strip()


def checks(nb) -> list[bool]:
    """Per cell: is it a hidden code cell of the Exercises section (the solutions' own code)?"""
    section, out = None, []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            section = ([section] + HEADING.findall(cell.source))[-1]
        out.append(section == "Exercises" and cell.cell_type == "code" and "remove-cell" in cell.metadata.get("tags", []))
    return out


def expected_cells(twin) -> list:
    """The twin's cells as the student notebook must hold them: the exercise checks left out,
    the solutions cut out of the markdown (a cell left empty goes), everything else as it is."""
    out = []
    for cell, check in zip(twin.cells, checks(twin)):
        if check:
            continue
        if cell.cell_type == "markdown" and SOLUTION.search(cell.source):
            cell = nbformat.from_dict(dict(cell, source=cut(cell.source)))
            if not cell.source:
                continue
        out.append(cell)
    return out


def fragments(line: str) -> list[str]:
    """Runs of plain words in a line of prose: what survives rendering (roles, code, math, quotes
    and dashes, which Sphinx rewrites, are split off)."""
    line = re.sub(r"\{[^}]+\}`[^`]*`|`[^`]*`|\$[^$]*\$", "|", line)
    return [f.strip() for f in re.split(r"[^A-Za-z0-9 ,.;:]", line) if len(f.split()) >= 4 and len(f.strip()) >= 24]


def allowed_text() -> str:
    """What a student may see: the twins minus solutions and exercise checks, the plain pages and
    ppo_lab's source (which the chapters show with literalinclude)."""
    parts = [p.read_text() for p in (ROOT / "book").glob("*.md") if p not in CHAPTERS]
    parts += [p.read_text() for p in (ROOT / "ppo_lab").rglob("*.py")]
    for md in CHAPTERS:
        nb = nbformat.read(md.with_suffix(".ipynb"), as_version=4)
        parts += [cut(c.source) if c.cell_type == "markdown" else c.source for c, check in zip(nb.cells, checks(nb)) if not check]
    return normal("\n".join(parts))


def solution_needles() -> dict[str, list[str]]:
    """Chapter name -> the distinctive lines of its solutions: code lines and prose fragments that
    appear nowhere a student may look."""
    allowed, needles = allowed_text(), {}
    for md in sorted((ROOT / "book").glob("*.md")):
        found = []
        for block in SOLUTION.finditer(md.read_text()):
            in_code = False
            for line in block["body"].splitlines():
                if line.startswith("```"):
                    in_code = not in_code
                    continue
                if in_code:
                    candidates = [line.strip()] if len(line.strip()) >= 20 else []
                else:
                    candidates = [] if line.startswith(":") else fragments(line)
                found += [c for c in candidates if normal(c) not in allowed]
        if found:
            needles[md.stem] = found
    return needles


def notebook_text(path: Path) -> str:
    nb = json.loads(path.read_text())
    parts = []
    for cell in nb["cells"]:
        parts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            parts.append(json.dumps(output, ensure_ascii=False))
    return "\n".join(parts)


def served_text(path: Path) -> str:
    """A file of the edition as its reader sees it."""
    if path.suffix == ".ipynb":
        return notebook_text(path)
    text = path.read_text(errors="ignore")
    return BeautifulSoup(text, "html.parser").get_text() if path.suffix == ".html" else text


def test_exercises_and_their_checks_sit_in_the_exercises_section():
    """The notebooks' exercise checks are found by section: an exercise, or a check cell, placed
    elsewhere would leave its solution's code to the students."""
    for md in CHAPTERS:
        nb = nbformat.read(md.with_suffix(".ipynb"), as_version=4)
        heads = []  # the `## ` headings so far
        for cell, check in zip(nb.cells, checks(nb)):
            if cell.cell_type == "markdown":
                exercise = EXERCISE.search(cell.source)
                if exercise:
                    assert (heads + HEADING.findall(cell.source[: exercise.start()]))[-1] == "Exercises", (md.name, cell.id)
                heads += HEADING.findall(cell.source)
            elif not check:
                assert not re.search(r"exercise|solution", cell.source.split("\n")[0], flags=re.I), (md.name, cell.id)


def test_the_build_passes_with_warnings_as_errors(edition):
    out, log = edition
    assert "build succeeded" in log and "WARNING" not in log, log[-5000:]
    for md in CHAPTERS:
        assert (out / "html" / "book" / f"{md.stem}.html").exists()
        assert (out / "notebooks" / f"{md.stem}.ipynb").exists()


def test_no_solution_text_anywhere(edition):
    out, _ = edition
    needles = solution_needles()
    # every solution yields some: the search below cannot pass for lack of anything to look for
    assert sum(len(SOLUTION.findall(md.read_text())) for md in CHAPTERS) >= 50
    assert sum(map(len, needles.values())) > 500, {k: len(v) for k, v in needles.items()}
    for name, found in needles.items():  # and each is found where it must be: in the full twin
        full = normal(notebook_text(ROOT / "book" / f"{name}.ipynb"))
        assert all(normal(n) in full for n in found), [n for n in found if normal(n) not in full]
    everything = [n for found in needles.values() for n in found]
    # _static holds the theme's and the extensions' assets (MathJax: 30 MB), copied, not built
    files = [p for p in out.rglob("*") if p.suffix in (".html", ".ipynb", ".js", ".md", ".txt") and "_static" not in p.parts]
    leaks = {}
    for path in files:
        text = normal(served_text(path))
        hits = [n for n in everything if normal(n) in text]
        if hits:
            leaks[str(path.relative_to(out))] = hits[:3]
    assert not leaks, leaks


def assignment_needles() -> dict[str, list[str]]:
    """Assignment -> the distinctive lines of its solution regions in ppo_lab's source: code lines
    that appear nowhere a student may look (the pages, and the package as the students receive it)."""
    allowed = [p.read_text() for p in (ROOT / "book").glob("*.md") if p not in CHAPTERS]
    for md in CHAPTERS:
        nb = nbformat.read(md.with_suffix(".ipynb"), as_version=4)
        allowed += [cut(c.source) if c.cell_type == "markdown" else c.source for c, check in zip(nb.cells, checks(nb)) if not check]
    needles: dict[str, list[str]] = {}
    regions = regions_in_package(ROOT / "ppo_lab")
    for path in (ROOT / "ppo_lab").rglob("*.py"):  # the package as the edition lists it
        rel = path.relative_to(ROOT / "ppo_lab").as_posix()
        allowed.append(skeleton(path.read_text(), {r.assignment for r in regions[rel]}) if rel in regions else path.read_text())
    for path, found in regions.items():
        text = (ROOT / "ppo_lab" / path).read_text()
        lines = text.split("\n")
        for region in found:
            needles.setdefault(region.assignment, []).extend(line.strip() for line in lines[region.begin + 1 : region.end])
    allowed_text = normal("\n".join(allowed))
    return {name: [n for n in found if len(n) >= 20 and not n.startswith("#") and normal(n) not in allowed_text]
            for name, found in needles.items()}


def test_no_assignment_solution_anywhere(edition):
    """Where a chapter lists a function that an assignment asks for, the student edition shows the
    skeleton the students receive (signature, docstring, checks), not the solution."""
    out, _ = edition
    needles = assignment_needles()
    # every assignment yields some, so the search below cannot pass for lack of anything to look for
    assert set(needles) == set(ASSIGNMENTS) and all(len(v) >= 2 for v in needles.values()), {k: len(v) for k, v in needles.items()}
    files = [p for p in out.rglob("*") if p.suffix in (".html", ".ipynb", ".js", ".md", ".txt") and "_static" not in p.parts]
    leaks = {}
    for path in files:
        text = normal(served_text(path))
        hits = [n for found in needles.values() for n in found if normal(n) in text]
        if hits:
            leaks[str(path.relative_to(out))] = hits[:3]
    assert not leaks, leaks
    # and the skeletons are what the chapters show in their place
    shown = normal(served_text(out / "html" / "book" / "ch07_ppo_trainer.html"))
    assert "ppo_update: not written yet (assignment 'ppo_update')" in shown
    assert "Assignment 'ppo_update': write this part of ppo_update." in shown


def test_no_solution_markup_in_the_html(edition):
    out, _ = edition
    for page in (out / "html").rglob("*.html"):
        html = page.read_text()
        assert 'class="solution' not in html and "Solution to" not in html and "solution-content" not in html, page


def test_every_exercise_is_kept(edition):
    out, _ = edition
    assert len(EXERCISE_PAGES) == len(CHAPTERS) - 1
    for md in EXERCISE_PAGES:
        exercises = list(EXERCISE.finditer(md.read_text()))
        assert exercises, md.name
        cells = [c.source for c in nbformat.read(out / "notebooks" / f"{md.stem}.ipynb", as_version=4).cells if c.cell_type == "markdown"]
        page = BeautifulSoup((out / "html" / "book" / f"{md.stem}.html").read_text(), "html.parser")
        for block in exercises:
            assert any(block[0] in cell for cell in cells), block[0][:200]
            label = re.search(r"^:label: *(\S+)", block["body"], flags=re.M)[1]
            shown = page.find(id=label)
            assert shown is not None and "exercise" in shown.get("class", []), (md.name, label)
            text = normal(shown.get_text())
            statement = [f for line in block["body"].splitlines() if not line.startswith(":") for f in fragments(line)]
            assert statement and all(normal(f) in text for f in statement), (label, [f for f in statement if normal(f) not in text])
            assert "{glue" not in text, (label, "a glued number is missing from the statement")


def test_notebooks_lose_only_the_solutions_and_their_checks(edition):
    out, _ = edition
    for md in CHAPTERS:
        twin = nbformat.read(md.with_suffix(".ipynb"), as_version=4)
        student = nbformat.read(out / "notebooks" / f"{md.stem}.ipynb", as_version=4)
        expected = expected_cells(twin)
        assert len(student.cells) == len(expected), md.name
        assert len(expected) < len(twin.cells) or md not in EXERCISE_PAGES, md.name  # every page with exercises checks them
        for new, old in zip(student.cells, expected):
            assert new == old, (md.name, old.get("id"))  # source, metadata and outputs alike
        assert twins.INSTALL_TAG in student.cells[0].metadata["tags"]  # Colab still installs ppo_lab
        assert student.metadata == twin.metadata
        # the pages' "download .ipynb" serves the student notebook, not Sphinx's copy of the source
        assert (out / "html" / "_sources" / "book" / f"{md.stem}.ipynb").read_bytes() == (out / "notebooks" / f"{md.stem}.ipynb").read_bytes()


def test_no_link_to_the_full_twins(edition):
    out, _ = edition
    for page in (out / "html" / "book").glob("*.html"):
        links = [a.get("href", "") for a in BeautifulSoup(page.read_text(), "html.parser").find_all("a")]
        assert not [h for h in links if "github.com/ppo-lab" in h or "colab.research" in h or "mybinder" in h], page
