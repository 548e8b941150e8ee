"""The drawing kit of the book's concept diagrams: page geometry, colours, boxes and arrows, and
the checks that stop the build when a diagram names something `ppo_lab` no longer has.

The diagrams themselves live in `diagrams_ppo.py` (chapters 1 to 7, the chapter map and appendix A)
and `diagrams_rlhf.py` (chapters 8 to 10); `concept_diagrams.py` lists them and draws them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the repository: book/_ext -> book -> root
OUTDIR = HERE.parent / "_diagrams"  # book/_diagrams, beside the chapters that show the figures
DPI = 150
FONT = 10  # points; the smallest text in any diagram

# three colours of Okabe and Ito's colour-blind-safe palette (the models' fills are ppo_lab.plotting's)
BLUE, GREEN, VERMILION = "#0072B2", "#009E73", "#D55E00"
INK, GREY, PAD = "0.15", "0.45", "0.88"
TENSOR_FILL, FUNCTION_FILL = "white", "#eeeeee"


def ppo_lab_package():
    """The ppo_lab beside the book (this repository's), not another installed copy; or the one
    under $PPO_LAB_SOURCE_ROOT, which the student edition sets, since the copy beside its scratch
    book holds the assignments' skeletons."""
    root = Path(os.environ.get("PPO_LAB_SOURCE_ROOT") or ROOT)
    if "ppo_lab" not in sys.modules and (root / "ppo_lab" / "__init__.py").exists():
        sys.path.insert(0, str(root))
        try:
            import ppo_lab  # noqa: F401
        finally:
            sys.path.remove(str(root))
    import ppo_lab

    return ppo_lab


def setting(group_cls, name: str) -> dataclasses.Field:
    """The field `name` of a config group, which must exist: the dotted name the book prints."""
    fields = {f.name: f for f in dataclasses.fields(group_cls)}
    if name not in fields:
        raise RuntimeError(f"diagrams: the setting {group_cls.key}.{name} is drawn but the config has no such field")
    return fields[name]


def require_arguments(fn, *names: str) -> None:
    """Stop the build unless `fn` takes arguments called `names`: the tensor names a diagram prints."""
    import inspect

    missing = [n for n in names if n not in inspect.signature(fn).parameters]
    require(not missing, f"{fn.__module__}.{fn.__name__} has no argument {', '.join(missing)}, which a diagram names")


def require(condition: bool, what: str) -> None:
    """Stop the build when the package no longer does what a diagram draws."""
    if not condition:
        raise RuntimeError(f"diagrams: {what}")


# --- drawing helpers ------------------------------------------------------------------------


def canvas(width: float, height: float, xmax: float = 100.0):
    """A figure with one frameless axes in data units (x from 0 to xmax, y scaled to keep aspect)."""
    fig = Figure(figsize=(width, height), dpi=DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    ymax = xmax * height / width
    ax.set_xlim(0, xmax)
    ax.set_ylim(0, ymax)
    ax.set_axis_off()
    return fig, ax, ymax


def box(ax, x0, y0, w, h, text, *, fill=TENSOR_FILL, edge=INK, mono=False, size=FONT, weight="normal", lw=1.0, gid=None, round_=0.8, ls="-"):
    """A rounded box with centred text; returns its (x0, y0, x1, y1)."""
    ax.add_patch(FancyBboxPatch((x0, y0), w, h, boxstyle=f"round,pad=0,rounding_size={round_}", fc=fill, ec=edge, lw=lw, ls=ls))
    ax.text(x0 + w / 2, y0 + h / 2, text, ha="center", va="center", fontsize=size, color=INK, weight=weight,
            family="monospace" if mono else "sans-serif", gid=gid, linespacing=1.25)
    return x0, y0, x0 + w, y0 + h


def arrow(ax, start, end, *, color=INK, lw=1.2, ls="-", style="-|>", rad=0.0, shrink=0.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=11, color=color, lw=lw, ls=ls,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=shrink, shrinkB=shrink))


def polyline(ax, points, *, color=INK, lw=1.2, ls="-"):
    """A polyline whose last segment ends in an arrow head."""
    xs, ys = zip(*points)
    ax.plot(xs[:-1], ys[:-1], color=color, lw=lw, ls=ls, solid_capstyle="butt")
    arrow(ax, points[-2], points[-1], color=color, lw=lw, ls=ls)
