"""The book's sources and their .ipynb twins stay in step (nbval itself runs in `make test`)."""

import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_scripts"))

import twins  # noqa: E402


def test_every_chapter_has_an_up_to_date_twin():
    out = subprocess.run([sys.executable, str(ROOT / "book/_scripts/twins.py"), "check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_twins_start_with_the_install_cell_and_have_outputs():
    assert twins.chapters(), "no chapters found in _toc.yml"
    for md in twins.chapters():
        nb = nbformat.read(md.with_suffix(".ipynb"), as_version=4)
        first = nb.cells[0]
        assert twins.INSTALL_TAG in first.metadata.get("tags", [])
        assert "pip install" in first.source and "find_spec('ppo_lab')" in first.source
        code = [c for c in nb.cells[1:] if c.cell_type == "code"]
        assert all(c.get("outputs") is not None for c in code)
        assert any(c.get("outputs") for c in code), f"{md.name}: the twin was never executed"


def test_check_notices_an_edited_source(tmp_path, monkeypatch):
    md = twins.chapters()[0]
    edited = tmp_path / md.name
    edited.write_text(md.read_text() + "\n```{code-cell} ipython3\nprint('new')\n```\n")
    twin = nbformat.read(md.with_suffix(".ipynb"), as_version=4)
    assert twins._cells(twin) != twins._cells(twins.twin_from_source(edited))


def test_chapters_import_ppo_lab_and_not_a_copy():
    for md in twins.chapters():
        text = md.read_text()
        assert "import ppo_lab" in text, md.name
        assert "def compute_gae" not in text and "def clipped_policy_loss" not in text
