"""Small helpers every chapter (from chapter 1 on) shares: reproducible set-up and glued numbers.

Every chapter starts with `ppo_lab.book.setup()`, so that its numbers are the same each time it
runs on the same machine (the book's stored outputs are checked against a fresh run), and
reports its measured numbers with `glue`, so the prose quotes the run instead of a constant.
"""

from __future__ import annotations

import random


def setup(seed: int = 0, threads: int = 1):
    """Seed Python, NumPy and torch, fix torch's CPU threads, and set the figure style.

    One thread: the order of floating-point reductions then depends only on the code, so a
    chapter reproduces its stored outputs exactly; the tiny models lose little speed by it.
    Returns the device to use ("cuda" when a GPU is present, else "cpu").
    """
    import warnings

    import numpy as np
    import torch
    from tqdm import TqdmWarning

    # tqdm.auto (used by transformers) warns in Jupyter when ipywidgets is missing; the book's
    # progress bars are plain text on purpose, so the warning is noise in every chapter.
    warnings.filterwarnings("ignore", category=TqdmWarning)
    torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    try:
        import matplotlib

        matplotlib.rcParams.update({"figure.figsize": (6.4, 3.6), "figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3})
    except ImportError:  # pragma: no cover
        pass
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def glue(name: str, value, display: bool = False) -> None:
    """Record `value` under `name` for the text ({glue:text}`name`).

    Uses myst-nb's glue when it is installed (the book build); elsewhere (Colab, a plain
    Jupyter) it does nothing, so a chapter runs the same everywhere. Returns None, so a glue at
    the end of a cell prints nothing.
    """
    try:
        from myst_nb import glue as _glue
    except ImportError:
        return
    _glue(name, value, display=display)
