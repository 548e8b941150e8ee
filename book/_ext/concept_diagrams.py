"""The book's concept diagrams, drawn by code at every build so that they cannot drift.

    python book/_ext/concept_diagrams.py OUTDIR      draws every diagram into OUTDIR as PNG

As a Sphinx extension (registered in _config.yml under `sphinx: local_extensions:`) it draws them
when the builder starts, into `book/_diagrams/`, which git ignores; the pages show them with
`{figure}` directives (`_diagrams/NAME.png`). A file is rewritten only when its image changed, so
an unchanged diagram does not make Sphinx read its page again.

The diagrams are drawn by `diagrams_ppo.py` (chapters 1 to 7, the chapter map, appendix A) and
`diagrams_rlhf.py` (chapters 8 to 10), with the kit of `diagram_kit.py`; each module's docstring
lists its diagrams and what `ppo_lab` computes for them.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import diagrams_ppo
import diagrams_rlhf
from diagram_kit import DPI, FONT, OUTDIR  # noqa: F401 - the figures' resolution and type size, read by the tests
from matplotlib.figure import Figure

DIAGRAMS = {**diagrams_ppo.DIAGRAMS, **diagrams_rlhf.DIAGRAMS}


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG, with no metadata that changes between runs."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def render(outdir: str | Path = OUTDIR, names=None) -> dict[str, bool]:
    """Draw the diagrams (all, or `names`) into `outdir` as NAME.png; returns {name: written},
    where written is False for a file that already held the same image."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in names or DIAGRAMS:
        data = png_bytes(DIAGRAMS[name]())
        path = outdir / f"{name}.png"
        written[name] = not (path.exists() and path.read_bytes() == data)
        if written[name]:
            path.write_bytes(data)
    return written


def _draw_all(app) -> None:
    from sphinx.util import logging

    written = render(OUTDIR)
    changed = [name for name, w in written.items() if w]
    logging.getLogger(__name__).info(f"diagrams: {len(written)} drawn into {OUTDIR}, {len(changed)} changed")


def setup(app):
    app.connect("builder-inited", _draw_all)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    for name, w in render(argv[0]).items():
        print(f"{name}.png {'written' if w else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
