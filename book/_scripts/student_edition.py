"""The student edition: the book's HTML and the chapters' notebooks, without the exercise solutions.

    python book/_scripts/student_edition.py OUTDIR     (`make student-book`: OUTDIR is _build/student)

writes

    OUTDIR/html/        the book, built with -W -n like the regular one, every `{solution}` left out,
                        and the course's assignments shown as skeletons where a chapter lists
                        their functions
    OUTDIR/notebooks/   the chapters' .ipynb twins for students, solutions and their checks left out

No chapter is executed: the twins (`book/*.ipynb`, see twins.py) hold every output, so the book is
built, with `execute_notebooks: off`, from copies of them in a scratch source tree, in which the
`{solution}` blocks are cut out of the markdown cells and each chapter is its .ipynb copy only.
It takes seconds, and refuses to run while a twin is out of date with its source (`make twins`).

The hidden (remove-cell) code cells of each Exercises section check the solutions' claims, and
their code is the solutions' code. The HTML build keeps them: they glue the numbers that some
exercise statements quote with `{glue:text}`, and remove-cell keeps their code and outputs off the
page (a number glued only for a solution has nowhere left to appear). The student notebooks drop
them. The install cell stays in both: hidden in the HTML, and on Colab it installs ppo_lab.

The scratch copy of _config.yml has no launch buttons and no repository links (they open the full
twins), and sets sphinx-exercise's `hide_solutions` as a second guard. The pages' "download .ipynb"
files (`_sources/`) are replaced by the student notebooks, which lack the checks' code.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import twins  # noqa: E402

from ppo_lab.course.regions import regions_in_package, skeleton  # noqa: E402

ROOT = twins.ROOT
COPIED = ["_toc.yml", "book/references.bib"]  # besides _static, ppo_lab and the plain pages
OPENING = re.compile(r"^(?P<fence>`{3,}|:{3,})\{(?P<name>[^}]+)\}")
EXERCISES = "Exercises"
HEADING = re.compile(r"^## +(.+?)\s*$", re.M)


def directive_spans(lines: list[str], name: str) -> list[tuple[int, int]]:
    """(first, last) line numbers of each `name` directive in a markdown cell's lines."""
    spans, i = [], 0
    while i < len(lines):
        m = OPENING.match(lines[i])
        if m and m["name"] == name:
            # CommonMark: the first line of at least as many of the same fence characters closes it
            close = re.compile(re.escape(m["fence"][0]) + "{%d,}\\s*" % len(m["fence"]))
            end = next((j for j in range(i + 1, len(lines)) if close.fullmatch(lines[j])), None)
            if end is None:
                raise ValueError(f"unclosed {{{name}}} block: {lines[i]!r}")
            spans.append((i, end))
            i = end
        i += 1
    return spans


def cut_solutions(text: str) -> str:
    """`text` without its `{solution}` blocks (and the blank lines after each)."""
    lines = text.split("\n")
    for first, last in reversed(directive_spans(lines, "solution")):
        while last + 1 < len(lines) and not lines[last + 1].strip():
            last += 1
        del lines[first : last + 1]
    return "\n".join(lines).rstrip("\n")


def sections(nb: nbformat.NotebookNode) -> list[str]:
    """The `## ` section each cell ends in (a markdown cell can open several)."""
    current, out = "", []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            current = ([current] + HEADING.findall(cell.source))[-1]
        out.append(current)
    return out


def is_check(cell: nbformat.NotebookNode, section: str) -> bool:
    """A hidden code cell of the Exercises section: it computes (and asserts) the solutions."""
    return section == EXERCISES and cell.cell_type == "code" and "remove-cell" in cell.metadata.get("tags", [])


def stripped(twin: Path, keep_checks: bool) -> nbformat.NotebookNode:
    """The twin with its solutions cut out, and its exercise checks unless `keep_checks`."""
    nb = nbformat.read(twin, as_version=4)
    cells = []
    for cell, section in zip(nb.cells, sections(nb)):
        if is_check(cell, section) and not keep_checks:
            continue
        if cell.cell_type == "markdown" and "{solution" in cell.source:
            cell.source = cut_solutions(cell.source)
            if "{solution" in cell.source:  # a form this script does not know (e.g. gated): no leak, fail
                raise SystemExit(f"{twin.name}: cell {cell.id} still holds a solution after cutting; extend student_edition.py")
            if not cell.source.strip():
                continue
        cells.append(cell)
    nb.cells = cells
    return nb


def write_config(tree: Path) -> dict:
    """_config.yml for the scratch tree: no execution, no links to the full twins, no solutions."""
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    cfg["title"] = f"{cfg['title']} (student edition)"
    cfg["execute"]["execute_notebooks"] = "off"
    # the chapters are their .ipynb copies here; the .md sources are not in the tree
    cfg["exclude_patterns"] = [p for p in cfg["exclude_patterns"] if not p.endswith(".ipynb")]
    for key in ("repository", "launch_buttons"):
        cfg.pop(key, None)
    cfg["html"].update(use_repository_button=False, use_issues_button=False, use_edit_page_button=False)
    cfg["sphinx"].setdefault("config", {})["hide_solutions"] = True
    (tree / "_config.yml").write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    return cfg


def write_tree(tree: Path) -> None:
    """The book's sources, each chapter as its twin with the solutions cut out (checks kept)."""
    cfg = write_config(tree)
    for name in COPIED:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    shutil.copytree(ROOT / "_static", tree / "_static")
    # the chapters' {literalinclude} ../ppo_lab/*.py show the package's own source: here the
    # assignments' skeletons, as the students receive them, not the solutions
    shutil.copytree(ROOT / "ppo_lab", tree / "ppo_lab", ignore=shutil.ignore_patterns("__pycache__"))
    for path, found in regions_in_package(tree / "ppo_lab").items():
        file = tree / "ppo_lab" / path
        file.write_text(skeleton(file.read_text(), {r.assignment for r in found}, str(file)))
    for folder in sorted(set((cfg["sphinx"].get("local_extensions") or {}).values())):  # the book's own Sphinx extensions
        shutil.copytree(ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    chapters = twins.chapters()
    for md in (ROOT / "book").glob("*.md"):
        if md not in chapters:
            shutil.copy2(md, tree / "book" / md.name)
    for md in chapters:
        nbformat.write(stripped(md.with_suffix(".ipynb"), keep_checks=True), tree / "book" / f"{md.stem}.ipynb")


def build(outdir: Path) -> int:
    # the edition is made from the twins: a source edited since `make twins` would be missed
    if twins.check() != 0:
        return 1
    html, notebooks = outdir / "html", outdir / "notebooks"
    for path in (html, notebooks):
        shutil.rmtree(path, ignore_errors=True)
    notebooks.mkdir(parents=True)
    for md in twins.chapters():
        nbformat.write(stripped(md.with_suffix(".ipynb"), keep_checks=False), notebooks / f"{md.stem}.ipynb")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        write_tree(tree)
        jb = Path(sys.executable).with_name("jupyter-book")
        # the concept diagrams compute with the package itself, not with the skeletons beside the tree
        env = dict(os.environ, PPO_LAB_SOURCE_ROOT=str(ROOT))
        proc = subprocess.run([str(jb), "build", str(tree), "-W", "-n", "--keep-going"], env=env)
        if proc.returncode != 0:
            return proc.returncode
        shutil.copytree(tree / "_build" / "html", html)
    # the pages' "download .ipynb" serves Sphinx's copy of each source, which still has the checks
    for nb in notebooks.glob("*.ipynb"):
        shutil.copy2(nb, html / "_sources" / "book" / nb.name)
    print(f"The student edition is in {html / 'index.html'} and {notebooks}/")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(build(Path(sys.argv[1]).resolve()))
