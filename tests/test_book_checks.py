"""The chapters' named checks: strict in the build and the tests, a plain note in a learner's kernel,
recorded one by one in a sweep; the sweep's reading of the pages; the twins' folded check cells."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from ppo_lab import book

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_scripts"))

import sweep  # noqa: E402
import twins  # noqa: E402


@pytest.fixture
def learner(monkeypatch):
    for name in (book.STRICT_VARIABLE, book.CHECK_LOG_VARIABLE, book.FAIL_CHECK_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_false_check_raises_only_when_strict(learner, capsys):
    assert book.check("ch00/x#1", True, 1.0) is True
    assert book.check("ch00/x#2", 0.3 > 0.5, 0.3) is False
    note = capsys.readouterr().out
    assert "ch00/x#2" in note and "0.3" in note and f"{book.SWEEP_SEEDS} seeds" in note and "goes on" in note
    learner.setenv(book.STRICT_VARIABLE, "1")
    assert book.check("ch00/x#1", True) is True
    with pytest.raises(AssertionError, match=r"ch00/x#2.*0\.3"):
        book.check("ch00/x#2", False, 0.3)


def test_a_bad_strict_value_is_named(learner):
    learner.setenv(book.STRICT_VARIABLE, "yes")
    with pytest.raises(ValueError, match="PPO_LAB_BOOK_STRICT='yes'"):
        book.check("ch00/x#1", False)


def test_every_check_is_logged_and_a_forced_failure_fails(learner, tmp_path):
    import torch

    log = tmp_path / "checks.jsonl"
    learner.setenv(book.CHECK_LOG_VARIABLE, str(log))
    learner.setenv(book.FAIL_CHECK_VARIABLE, "ch00/x#3")
    book.check("ch00/x#1", torch.tensor(True))
    book.check("ch00/x#2", torch.tensor([0.0]).item() > 1, "long" * 200)
    book.check("ch00/x#3", True)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["name"], r["passed"]) for r in rows] == [("ch00/x#1", True), ("ch00/x#2", False), ("ch00/x#3", False)]
    assert rows[0]["values"] is None and len(rows[1]["values"]) <= 400


def test_check_names_are_unique_and_the_pages_assert_nothing_bare():
    """Every hidden claim is a named check: a bare `assert` would stop a learner's kernel."""
    import ast

    for md in twins.chapters():
        names = []
        for src in sweep.code_cells(md):
            names += sweep.CHECK_NAME.findall(src)
            for node in ast.walk(ast.parse(src)):
                assert not isinstance(node, ast.Assert), f"{md.name}: a bare assert at line {node.lineno} of a cell"
        assert len(names) == len(set(names)), f"{md.name}: check names written twice"
        prefix = names[0].split("/")[0] if names else ""
        assert all(n.split("/")[0] == prefix for n in names), md.name


def test_the_sweep_reads_the_same_code_cells_as_jupytext():
    for md in twins.chapters():
        expected = [c.source for c in jupytext.read(md).cells if c.cell_type == "code"]
        assert sweep.code_cells(md) == expected, md.name


def test_the_twins_fold_the_hidden_cells_with_a_title():
    for md in twins.chapters():
        twin = twins.twin_from_source(md)
        hidden = [c for c in twin.cells[1:] if "remove-cell" in c.metadata.get("tags", [])]
        for cell in hidden:
            assert cell.metadata["jupyter"]["source_hidden"] is True and cell.metadata["cellView"] == "form"
            assert cell.source.startswith("#@title "), (md.name, cell.source[:60])
        shown = [c for c in twin.cells[1:] if c.cell_type == "code" and "remove-cell" not in c.metadata.get("tags", [])]
        assert all("jupyter" not in c.metadata for c in shown)


def test_the_sweep_seed_count_is_the_committed_tables():
    text = (ROOT / "book" / "sweep.md").read_text()
    line = next(line for line in text.splitlines() if line.startswith("Book seeds:"))
    assert len(line.split(":", 1)[1].split(",")) == book.SWEEP_SEEDS


def _notebook(tmp_path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def test_a_failed_check_in_a_kernel_prints_the_note_and_the_notebook_goes_on(learner, tmp_path):
    cells = ["from ppo_lab.book import check", 'check("ch00/claim#1", 2 < 1, {"score": 0.42})', "print('the end')"]
    nb = _notebook(tmp_path, *cells)
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    out = "".join(o.get("text", "") for c in nb.cells for o in c.outputs)
    assert "Note: the claim checked by ch00/claim#1 did not hold" in out and "0.42" in out and "the end" in out
    learner.setenv(book.STRICT_VARIABLE, "1")
    nb = _notebook(tmp_path, *cells)
    with pytest.raises(CellExecutionError, match="ch00/claim#1"):
        NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    assert not nb.cells[2].outputs


def test_a_chapter_with_a_check_forced_to_fail_runs_to_the_end_for_a_learner(tmp_path):
    """Chapter 1 (the shortest) with its first check failing: a plain run notes it and finishes; a strict run stops."""
    md = ROOT / "book" / "ch01_rl_for_language_models.md"
    first = sweep.check_names(md)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PPO_LAB_BOOK_")}
    env.update(PPO_LAB_BOOK_FAIL_CHECK=first, PPO_LAB_BOOK_CHECK_LOG=str(tmp_path / "log.jsonl"), MPLBACKEND="Agg")
    script = f"import sys; sys.path.insert(0, {str(ROOT / 'book/_scripts')!r}); import sweep; sweep._execute(sweep.Path({str(md)!r}))"
    lax = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert f"Note: the claim checked by {first} did not hold" in lax.stdout
    result = json.loads(lax.stdout.strip().splitlines()[-1])
    assert result["error"] is None, lax.stdout[-2000:]
    # each code cell's seconds, for the sweep's record of where a page's time goes
    assert len(result["cells"]) == len(sweep.code_cells(md)) and all(t >= 0 for t in result["cells"])
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    ran = {row["name"] for row in rows if "name" in row}
    assert ran == set(sweep.check_names(md)), "a plain run did not reach every check"
    strict = subprocess.run([sys.executable, "-c", script], env={**env, "PPO_LAB_BOOK_STRICT": "1"},
                            capture_output=True, text=True, timeout=300)
    assert f"AssertionError: check {first} failed" in json.loads(strict.stdout.strip().splitlines()[-1])["error"]
