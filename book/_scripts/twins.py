"""The chapters' .ipynb twins: generate them from the .md sources, check them, cache them.

Each chapter is a MyST-NB markdown notebook (`book/*.md` with a jupytext header), the single
source of its text and code. Beside it sits an .ipynb twin, generated here and never edited by
hand, which the Colab and Binder buttons open and nbval checks:

    python book/_scripts/twins.py sync [CHAPTER ...]   regenerate twins and execute them in place
    python book/_scripts/twins.py check                exit 1 if a twin's cells differ from its source
    python book/_scripts/twins.py cache DIR            put the executed twins into a jupyter-cache at DIR
    python book/_scripts/twins.py list                 print the twins of the chapters in _toc.yml
    python book/_scripts/twins.py run CHAPTER [--seed N] [--threads N] [--out FILE]
                                                       execute a chapter under another seed or thread
                                                       count (PPO_LAB_BOOK_SEED, PPO_LAB_BOOK_THREADS),
                                                       leaving its twin alone

Cells the book hides (tag `remove-cell`: the checks of the chapter's claims, and the numbers the
text quotes) are folded in the twin (`collapse`), each showing its `#@title` line in Colab.

The twin has one cell more than its source, first: it installs ppo_lab where it is missing (Colab),
from the repository named in _config.yml, and does nothing where ppo_lab is importable.
`cache` lets the book build render the nbval-verified outputs instead of executing every chapter
a second time: jupyter-cache matches notebooks by their code cells (sources and metadata), so
each chapter is stored as the build reads it, with its twin's outputs (`cached_notebook`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jupytext
import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TAG = "ppo-lab-install"


def toc_pages() -> list[Path]:
    """Every markdown page listed in _toc.yml, in order: the pages that are built."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections"))
            walk(entry.get("chapters"))

    walk(toc.get("parts"))
    walk(toc.get("chapters"))
    return [ROOT / f"{name}.md" for name in files]


def chapters() -> list[Path]:
    """The executable chapters listed in _toc.yml, in order (markdown files with a kernel)."""
    out = []
    for path in toc_pages():
        text = path.read_text() if path.exists() else ""
        if text.startswith("---") and "kernelspec:" in text.split("---", 2)[1]:
            out.append(path)
    return out


def install_cell() -> nbformat.NotebookNode:
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    source = (
        "# Colab / Binder: install ppo_lab if it is missing (does nothing where it is installed).\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('ppo_lab') is None:\n"
        f"    %pip install --quiet 'ppo-lab @ git+{cfg['url']}@{cfg['branch']}'"
    )
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": [INSTALL_TAG, "remove-cell"]})
    cell.id = "install-ppo-lab"
    return cell


def collapse(cell: nbformat.NotebookNode) -> None:
    """Fold a cell the book hides (its checks, the numbers the text quotes) in Jupyter and Colab.

    The book drops `remove-cell` cells; Jupyter and Colab ignore that tag, so a learner would
    scroll past pages of checks. JupyterLab and Notebook 7 fold a cell whose
    `metadata.jupyter.source_hidden` is true; Colab shows a cell with `cellView: form` as the
    title on its first `#@title` line. Outputs stay visible: a failed check's note is read.
    """
    cell.metadata["jupyter"] = {"source_hidden": True}
    cell.metadata["cellView"] = "form"


def twin_from_source(md: Path) -> nbformat.NotebookNode:
    nb = jupytext.read(md)
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:03d}"  # stable ids: regenerating a twin changes nothing that did not change
        cell.metadata.pop("lines_to_next_cell", None)
        if "remove-cell" in cell.metadata.get("tags", []):
            collapse(cell)
    nb.cells.insert(0, install_cell())
    nb.metadata.pop("jupytext", None)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    return nb


def _cells(nb):
    return [(c.cell_type, c.source, sorted(c.metadata.get("tags", []))) for c in nb.cells]


def sync(paths: list[Path]) -> None:
    for md in paths:
        twin = md.with_suffix(".ipynb")
        nbformat.write(twin_from_source(md), twin)
        print(f"executing {twin.relative_to(ROOT)}", flush=True)
        subprocess.run([sys.executable, "-m", "jupyter", "execute", "--inplace", "--timeout=600", str(twin)], check=True, cwd=twin.parent)
        # execution counts and timings are noise in a diff; keep the outputs only
        nb = nbformat.read(twin, as_version=4)
        nb.metadata.pop("widgets", None)
        for cell in nb.cells:
            cell.metadata.pop("execution", None)
        nbformat.write(nb, twin)


def run(md: Path, seed: int | None, threads: int | None, out: Path | None) -> int:
    """Execute a chapter from its source in a scratch copy; the twin is not touched."""
    env = dict(os.environ)
    if seed is not None:
        env["PPO_LAB_BOOK_SEED"] = str(seed)
    if threads is not None:
        env["PPO_LAB_BOOK_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as tmp:
        nb_path = Path(tmp) / md.with_suffix(".ipynb").name
        nbformat.write(twin_from_source(md), nb_path)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "jupyter", "execute", "--inplace", "--timeout=600", str(nb_path)], env=env, cwd=md.parent)
        took = time.perf_counter() - start
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(nb_path.read_bytes())
    label = f"seed={env.get('PPO_LAB_BOOK_SEED', 'default')} threads={env.get('PPO_LAB_BOOK_THREADS', 'default')}"
    print(f"{md.name} {label}: {'ok' if proc.returncode == 0 else 'FAILED'} in {took:.0f} s", flush=True)
    return proc.returncode


def check() -> int:
    stale = []
    for md in chapters():
        twin = md.with_suffix(".ipynb")
        if not twin.exists() or _cells(nbformat.read(twin, as_version=4)) != _cells(twin_from_source(md)):
            stale.append(twin.relative_to(ROOT))
    for path in stale:
        print(f"out of date: {path} (run `make twins`)")
    return 1 if stale else 0


def cached_notebook(md: Path) -> nbformat.NotebookNode:
    """The chapter as the book build reads it, carrying its twin's stored outputs.

    jupyter-cache keys a notebook on its code cells' sources and all their metadata, and the
    twin's cells carry metadata the build's reader does not give them (the folding of `collapse`),
    so the twin itself would never match: the build reads `md` with MyST-NB's own reader and
    the outputs are copied over, cell by cell, from the twin whose sources are checked equal.
    """
    from myst_nb.core.read import read_myst_markdown_notebook

    nb = read_myst_markdown_notebook(md.read_text(encoding="utf-8"))
    twin = nbformat.read(md.with_suffix(".ipynb"), as_version=4)
    stored = [c for c in twin.cells if c.cell_type == "code" and INSTALL_TAG not in c.metadata.get("tags", [])]
    code = [c for c in nb.cells if c.cell_type == "code"]
    if [c.source for c in code] != [c.source for c in stored]:
        raise SystemExit(f"{md.with_suffix('.ipynb').name} is out of date with {md.name} (run `make twins`)")
    for cell, done in zip(code, stored):
        cell.outputs = done.outputs
        cell.execution_count = done.execution_count
    return nb


def cache(directory: str) -> None:
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    store = get_cache(directory)
    for md in chapters():
        store.cache_notebook_bundle(CacheBundleIn(cached_notebook(md), str(md)), check_validity=False, overwrite=True)


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["check"]
    if command == "sync":
        sync([Path(p).resolve() for p in rest] or chapters())
    elif command == "check":
        sys.exit(check())
    elif command == "cache":
        cache(rest[0])
    elif command == "run":
        parser = argparse.ArgumentParser(prog="twins.py run")
        parser.add_argument("chapter", type=Path)
        parser.add_argument("--seed", type=int)
        parser.add_argument("--threads", type=int)
        parser.add_argument("--out", type=Path)
        a = parser.parse_args(rest)
        sys.exit(run(a.chapter.resolve(), a.seed, a.threads, a.out))
    elif command == "list":
        print(" ".join(str(md.with_suffix(".ipynb").relative_to(ROOT)) for md in chapters()))
    else:
        sys.exit(f"unknown command {command!r}: use sync, check, cache, run or list")
