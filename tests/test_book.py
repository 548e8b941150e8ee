"""The book's sources and their .ipynb twins stay in step (nbval itself runs in `make test`)."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

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


def test_the_cache_serves_every_chapter_to_the_build(tmp_path):
    # `make test` builds the book from a jupyter-cache filled with the twins' outputs; a chapter
    # the cache does not match is executed again by the build (25 minutes more on 2 cores).
    # The build reads each chapter with MyST-NB's reader and looks it up the way done here.
    from jupyter_cache import get_cache
    from myst_nb.core.read import read_myst_markdown_notebook

    out = subprocess.run([sys.executable, str(ROOT / "book/_scripts/twins.py"), "cache", str(tmp_path / "cache")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    store = get_cache(str(tmp_path / "cache"))
    for md in twins.chapters():
        nb = read_myst_markdown_notebook(md.read_text(encoding="utf-8"))
        record = store.match_cache_notebook(nb)  # raises KeyError when nothing matches
        _, merged = store.merge_match_into_notebook(nb)
        twin = nbformat.read(md.with_suffix(".ipynb"), as_version=4)
        stored = [c.outputs for c in twin.cells[1:] if c.cell_type == "code"]
        assert [c.outputs for c in merged.cells if c.cell_type == "code"] == stored, md.name
        assert record.uri == str(md)


def test_a_twin_out_of_step_is_not_cached(tmp_path):
    md = twins.chapters()[0]
    edited = tmp_path / md.name
    edited.write_text(md.read_text().replace("import ppo_lab", "import ppo_lab  # edited", 1))
    (tmp_path / md.with_suffix(".ipynb").name).write_bytes(md.with_suffix(".ipynb").read_bytes())
    with pytest.raises(SystemExit, match="out of date"):
        twins.cached_notebook(edited)


def test_chapters_import_ppo_lab_and_not_a_copy():
    for md in twins.chapters():
        text = md.read_text()
        assert "import ppo_lab" in text, md.name
        assert "def compute_gae" not in text and "def clipped_policy_loss" not in text


def test_book_seed_comes_from_the_environment(monkeypatch):
    import torch

    from ppo_lab import book

    monkeypatch.delenv(book.SEED_VARIABLE, raising=False)
    monkeypatch.delenv(book.THREADS_VARIABLE, raising=False)
    threads = torch.get_num_threads()
    try:
        assert book.setup()[0] == 0
        a = torch.rand(3)
        monkeypatch.setenv(book.SEED_VARIABLE, "7")
        seed, device = book.setup()
        assert seed == 7 and device.type in ("cpu", "cuda")
        assert not torch.equal(torch.rand(3), a)  # another seed, other draws
        assert book.setup(seed=3)[0] == 3  # an explicit seed wins
        monkeypatch.setenv(book.THREADS_VARIABLE, "2")
        book.setup()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("value", ["one", "-1", "1.5"])
def test_a_bad_book_seed_is_named(monkeypatch, value):
    from ppo_lab import book

    monkeypatch.setenv(book.SEED_VARIABLE, value)
    with pytest.raises(ValueError, match=f"PPO_LAB_BOOK_SEED={value!r}.*integer >= 0"):
        book.book_seed()


def test_chapters_take_every_seed_from_the_book_seed():
    """`PPO_LAB_BOOK_SEED` must change every draw of a chapter: no seed may be a bare constant."""
    import re

    bare = re.compile(r"(manual_seed\(\s*\d+\s*\)|\bseed\s*=\s*\d+\b|random\.Random\(\s*\d+\s*\)|np\.random\.seed\(\s*\d)")
    for md in twins.chapters():
        code = re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```", md.read_text(), flags=re.S)
        hits = [m.group(0) for block in code for m in bare.finditer(block)]
        assert not hits, f"{md.name}: seeds not derived from setup()'s seed: {hits}"
        assert "seed, device = setup()" in md.read_text(), f"{md.name}: first cell must take its seed from setup()"


def test_book_config_gives_each_run_a_fresh_folder_and_keeps_overrides():
    from ppo_lab.book import config

    a, b = config({"run.seed": 3}), config({"run.seed": 3}, {"run.eval_interval": 5})
    assert a.run.output_dir != b.run.output_dir and a.policy.model == "builtin:tiny"
    assert (a.run.eval_interval, a.run.progress_bar, b.run.eval_interval, b.run.seed) == (0, False, 5, 3)
    assert config({"run.output_dir": "/tmp/x"}).run.output_dir == "/tmp/x"
    with pytest.raises(ValueError, match="learning_rate is now optim.lr"):
        config({"learning_rate": 1e-3})


def test_band_draws_median_and_range_and_leaves_gaps_for_missing_metrics():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ppo_lab.book import band

    runs = [[{"iteration": i, "m": float(i + k)} for i in (1, 2, 3)] for k in (0, 1, 5)]
    runs[0][0].pop("m")  # e.g. a value warm-up iteration has no policy metrics
    fig, ax = plt.subplots()
    line = band(ax, runs, "m")
    ys = list(line.get_ydata())
    assert ys[1:] == [3.0, 4.0] and ys[0] != ys[0]  # medians; nan where a run lacks the metric
    plt.close(fig)
    fig, ax = plt.subplots()
    line = band(ax, runs[1:], "m")  # two runs: the median is their midpoint, not the lower one
    assert list(line.get_ydata()) == [4.0, 5.0, 6.0]
    plt.close(fig)


def test_glossary_is_sorted_and_every_term_has_its_chinese_equivalent():
    import re

    text = (ROOT / "book" / "glossary.md").read_text()
    body = text.split("```{glossary}\n", 1)[1].rsplit("```", 1)[0]
    entries = re.findall(r"^(\S[^\n]*)\n((?:[ ]{2}[^\n]*\n?)+)", body, flags=re.M)
    terms = [t for t, _ in entries]
    assert len(terms) > 50 and terms == sorted(terms, key=str.lower), [a for a, b in zip(terms, terms[1:]) if a.lower() > b.lower()]
    han = re.compile(r"[\u4e00-\u9fff]")
    assert all(han.search(d.splitlines()[0]) for _, d in entries), [t for t, d in entries if not han.search(d.splitlines()[0])]


def test_the_web_font_holds_every_chinese_character_of_the_book():
    """The glossary's Chinese terms render without a system CJK font (a minimal Linux, a
    headless browser): `_static/` ships a Noto Sans CJK SC subset that `_static/cjk.css`
    declares; a page that gains a character the subset lacks fails here."""
    from fontTools.ttLib import TTFont

    import cjk_font

    font_file = ROOT / "_static" / "noto-sans-sc-subset.woff2"
    cmap = TTFont(font_file).getBestCmap()
    needed = cjk_font.characters()
    assert len(needed) > 100 and "奖" in needed and "励" in needed
    missing = "".join(c for c in needed if ord(c) not in cmap)
    assert not missing, f"the web font lacks {missing!r}: run python book/_scripts/cjk_font.py FONT (see its docstring)"
    assert font_file.stat().st_size < 100 * 1024  # a subset, not the whole font
    assert "noto-sans-sc-subset.woff2" in (ROOT / "_static" / "cjk.css").read_text()
