"""The book's concept diagrams (book/_ext/concept_diagrams.py): each is drawn, legible, and shown.

The build draws them into book/_diagrams/ when it starts; these tests draw them into a temporary
folder, check each image and its text, and check that every `{figure}` of a page names a diagram
that is drawn, so that a page cannot point at an image the build never makes.
"""

import re
import struct
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
import concept_diagrams  # noqa: E402

FIGURE = re.compile(r"^(`{3,}|:{3,})\{figure\}\s+(?P<path>\S+)", re.M)
CHAPTERS = {"rlhf_loop": "ch01_", "reinforce_flow": "ch02_", "gae_recursion": "ch04_", "kl_placement": "ch05_", "clip_regions": "ch06_",
            "trainer_iteration": "ch07_", "bradley_terry": "ch08_", "sampler_trainer": "ch09_", "group_advantages": "ch10_",
            "score_placement": "appendix_a_", "chapter_map": "ppo_in_one_screen"}


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG header."""
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def page_figures() -> dict[str, list[str]]:
    """Page name -> the image paths of its {figure} directives, for every page of the book."""
    return {md.stem: [m["path"] for m in FIGURE.finditer(md.read_text())] for md in sorted((ROOT / "book").glob("*.md"))}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("diagrams")
    written = concept_diagrams.render(out)
    return out, written


def test_every_diagram_is_drawn_to_a_png_of_book_width(rendered):
    out, written = rendered
    assert set(written) == set(concept_diagrams.DIAGRAMS) == set(CHAPTERS)
    for name in concept_diagrams.DIAGRAMS:
        path = out / f"{name}.png"
        assert path.exists() and path.stat().st_size > 20_000, name
        width, height = png_size(path)
        assert 8 * concept_diagrams.DPI <= width <= 10 * concept_diagrams.DPI and 3 * concept_diagrams.DPI <= height, (name, width, height)


def test_an_unchanged_diagram_is_not_rewritten(rendered):
    out, _ = rendered
    assert concept_diagrams.render(out) == {name: False for name in concept_diagrams.DIAGRAMS}


@pytest.mark.parametrize("name", sorted(CHAPTERS))
def test_no_text_overlaps_another_or_leaves_the_figure(name):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = concept_diagrams.DIAGRAMS[name]()
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    texts = list(fig.texts)
    for ax in fig.axes:
        texts += list(ax.texts) + [ax.title, ax.xaxis.label, ax.yaxis.label]
        if ax.get_legend() is not None:
            texts += list(ax.get_legend().get_texts())
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_text().strip() and t.get_visible()]
    page = fig.bbox
    for text, box in boxes:
        assert box.x0 >= page.x0 and box.x1 <= page.x1 and box.y0 >= page.y0 and box.y1 <= page.y1, (name, text)
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1 :]:
            assert not box_a.overlaps(box_b), (name, a, b)
    assert min(t.get_fontsize() for t in texts if t.get_text().strip()) >= concept_diagrams.FONT - 1e-9, name


def test_every_figure_of_a_page_is_a_drawn_diagram_and_each_diagram_is_shown_in_its_chapter():
    shown = {}
    for page, paths in page_figures().items():
        for path in paths:
            assert path.startswith("_diagrams/") and path.endswith(".png"), (page, path)
            name = path[len("_diagrams/") : -len(".png")]
            assert name in concept_diagrams.DIAGRAMS, f"{page} shows {path}, which book/_ext/concept_diagrams.py does not draw"
            shown.setdefault(name, []).append(page)
    assert {name: [p for p in pages if p.startswith(CHAPTERS.get(name, "?"))] for name, pages in shown.items()} == {name: pages for name, pages in shown.items()}
    assert sorted(shown) == sorted(CHAPTERS) and all(len(pages) == 1 for pages in shown.values()), shown


def prose_words_before_figure(text: str, image: str) -> int:
    """Words of a page's markdown before its {figure} of `image`: front matter and code cells left out."""
    text = re.sub(r"\A---\n.*?\n---\n", "", text, flags=re.S)
    words, in_code = 0, False
    for line in text.splitlines():
        if line.startswith("```{figure}") and image in line:
            return words
        if line.startswith("```{code-cell}"):
            in_code = True
        elif in_code and line.startswith("```"):
            in_code = False
        elif not in_code:
            words += len(line.split())
    raise AssertionError(f"no figure of {image}")


@pytest.mark.parametrize("name", sorted(set(CHAPTERS) - {"chapter_map"}))  # the opening page opens with its run
def test_each_chapter_shows_its_diagram_within_its_first_400_words(name):
    (md,) = (ROOT / "book").glob(f"{CHAPTERS[name]}*.md")
    assert prose_words_before_figure(md.read_text(), f"_diagrams/{name}.png") <= 400


def test_the_build_draws_the_diagrams_into_the_folder_the_pages_read_and_git_ignores():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["sphinx"]["local_extensions"]["concept_diagrams"] == "book/_ext"
    assert concept_diagrams.OUTDIR == ROOT / "book" / "_diagrams"
    assert "book/_diagrams/" in (ROOT / ".gitignore").read_text().splitlines()


def words_before_first_figure_or_output(md: Path) -> int:
    """Words of prose a reader meets before a page's first figure or first shown output: its
    markdown read up to a `{figure}` or to a code cell whose output the book shows (the outputs
    are those of the page's executed twin, `.ipynb`; a cell the book hides does not count)."""
    import jupytext
    import nbformat

    twin = nbformat.read(md.with_suffix(".ipynb"), as_version=4)
    outputs = [c.outputs for c in twin.cells if c.cell_type == "code" and "ppo-lab-install" not in c.metadata.get("tags", [])]
    source = jupytext.read(md)
    words, k = 0, 0
    for cell in source.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if FIGURE.match(line):
                    return words
                words += len(line.split())
        elif cell.cell_type == "code":
            tags = cell.metadata.get("tags", [])
            shown = [o for o in outputs[k] if o.get("output_type") in ("stream", "display_data", "execute_result")]
            if shown and not {"remove-cell", "remove-output", "hide-output"} & set(tags):
                return words
            k += 1
    raise AssertionError(f"{md.name} shows no figure and no output")


def test_every_executed_page_shows_a_figure_or_an_output_within_its_first_400_words():
    sys.path.insert(0, str(ROOT / "book" / "_scripts"))
    from twins import chapters

    pages = chapters()
    assert len(pages) >= 14, pages  # the opening page, chapters 1-10, appendices A-C
    counts = {md.name: words_before_first_figure_or_output(md) for md in pages}
    assert {name: n for name, n in counts.items() if n > 400} == {}, counts
