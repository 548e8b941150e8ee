"""Small helpers every chapter (from chapter 1 on) shares: reproducible set-up and glued numbers.

Every chapter starts with `ppo_lab.book.setup()`, so that its numbers are the same each time it
runs on the same machine, and reports its measured numbers with `glue`, so the prose quotes the
run instead of a constant.

A chapter's claims must hold for any seed, not for the stored run's draws: set
`PPO_LAB_BOOK_SEED` (and `PPO_LAB_BOOK_THREADS`) to rerun a chapter under another seed (thread
count); `make test` executes every chapter once under a seed other than the stored one.

Every claim a chapter makes about its runs is checked by a named `check` in a hidden cell. How a
failed check acts depends on who runs the page:
- the book build and `make test` set `PPO_LAB_BOOK_STRICT=1`: a failed check raises, so a claim
  that no longer holds stops the build;
- in a learner's own kernel (Jupyter, Colab) it prints one plain note and the notebook goes on:
  the claims were swept over many seeds (`book/sweep.md`), and another machine's floats may draw
  a run outside them;
- the sweep (`book/_scripts/sweep.py`) sets `PPO_LAB_BOOK_CHECK_LOG` to a file and records
  every check, so that one failure does not hide the page's other checks.
"""

from __future__ import annotations

import os
import random

SEED_VARIABLE = "PPO_LAB_BOOK_SEED"
THREADS_VARIABLE = "PPO_LAB_BOOK_THREADS"
STRICT_VARIABLE = "PPO_LAB_BOOK_STRICT"
CHECK_LOG_VARIABLE = "PPO_LAB_BOOK_CHECK_LOG"
# Forces the named check to fail: how a test shows what a learner and the build each see.
FAIL_CHECK_VARIABLE = "PPO_LAB_BOOK_FAIL_CHECK"
# The seeds of the committed sweep (book/sweep.md), quoted in a learner's note; a test keeps the
# two equal.
SWEEP_SEEDS = 12


def _env_int(name: str, default: int, low: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        raise ValueError(f"{name}={raw!r}: expected an integer >= {low}")
    return value


def book_seed(default: int = 0) -> int:
    """The chapters' seed: `$PPO_LAB_BOOK_SEED` when set, else `default` (the stored run's)."""
    return _env_int(SEED_VARIABLE, default, 0)


def setup(seed: int | None = None, threads: int | None = None):
    """Seed Python, NumPy and torch, fix torch's CPU threads, and set the figure style.

    `seed` defaults to `book_seed()` (0 unless `PPO_LAB_BOOK_SEED` is set), `threads` to
    `$PPO_LAB_BOOK_THREADS` or 1. One thread keeps timings steady on a busy 2-core machine;
    the chapters' claims do not depend on it. Returns the seed used and the device
    ("cuda" when a GPU is present, else "cpu") as `(seed, device)`.
    """
    import warnings

    import numpy as np
    import torch
    from tqdm import TqdmWarning

    # tqdm.auto (used by transformers) warns in Jupyter when ipywidgets is missing; the book's
    # progress bars are plain text on purpose, so the warning is noise in every chapter.
    warnings.filterwarnings("ignore", category=TqdmWarning)
    seed = book_seed() if seed is None else seed
    threads = _env_int(THREADS_VARIABLE, 1, 1) if threads is None else threads
    torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    try:
        import matplotlib

        matplotlib.rcParams.update({"figure.figsize": (6.4, 3.6), "figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3})
    except ImportError:  # pragma: no cover
        pass
    return seed, torch.device("cuda" if torch.cuda.is_available() else "cpu")


def glue(name: str, value, display: bool = False) -> None:
    """Record `value` under `name` for the text ({glue:text}`name`).

    Uses myst-nb's glue when it is installed (the book build); elsewhere (Colab, a plain
    Jupyter) it does nothing, so a chapter runs the same everywhere. Under a sweep
    (`PPO_LAB_BOOK_CHECK_LOG` set) it appends `{"glue", "value"}` to that file instead. Returns
    None, so a glue at the end of a cell prints nothing.
    """
    log = os.environ.get(CHECK_LOG_VARIABLE, "")
    if log:  # the sweep keeps every glued number, to read the prose against many runs
        import json

        with open(log, "a") as f:
            f.write(json.dumps({"glue": name, "value": _short([value], 200)}) + "\n")
        return
    try:
        from myst_nb import glue as _glue
    except ImportError:
        return
    _glue(name, value, display=display)


def config(*settings: dict):
    """A `PPOConfig` for a chapter's run: the offline tiny model, no evaluation, no progress
    bar and a fresh temporary `run.output_dir`; `settings` (dicts of dotted names such as
    `{"optim.lr": 5e-4}`, applied in order) override any of it.

    A chapter pins every setting its claims rest on (its own dict passed here), so that it does
    not change when the package's defaults do.
    """
    import tempfile

    from .config import PPOConfig, nest

    base = {"policy.model": "builtin:tiny", "run.eval_interval": 0, "run.progress_bar": False}
    merged = nest(base, *settings)
    if not merged["run"].get("output_dir"):
        merged["run"]["output_dir"] = tempfile.mkdtemp(prefix="ppo_lab-book-")
    return PPOConfig(**merged)


def train(*settings: dict, reward_fn=None, train_prompts=None, eval_prompts=None, gold_fn=None):
    """Train a fresh `PPOTrainer` on `config(*settings)` for its `run.iterations`; returns
    `(trainer, history)`, the history being one metrics dict per iteration. `reward_fn`, the
    prompts and `gold_fn` go to `PPOTrainer` as they are (default: the task's; no gold)."""
    from .trainer import PPOTrainer

    trainer = PPOTrainer(config(*settings), reward_fn=reward_fn, train_prompts=train_prompts, eval_prompts=eval_prompts, gold_fn=gold_fn)
    return trainer, trainer.train()


def band(ax, histories: list[list[dict]], key: str, **style):
    """Plot metric `key` of several runs (one history each, e.g. one per seed) on `ax`: their
    median as a line and their min-to-max range as a band. Returns the line. Iterations without
    the metric (a value warm-up has no policy/* metrics) are gaps."""
    import torch

    ys = torch.tensor([[row.get(key, float("nan")) for row in history] for history in histories], dtype=torch.float64)
    its = [row["iteration"] for row in histories[0]]
    # quantile, not Tensor.median: for an even number of runs median() returns the lower middle
    # value, so with two seeds the "median" line would sit on the band's lower edge.
    (line,) = ax.plot(its, ys.quantile(0.5, dim=0), "o-", ms=3, **style)
    ax.fill_between(its, ys.min(0).values, ys.max(0).values, color=line.get_color(), alpha=0.2)
    return line


def _strict() -> bool:
    raw = os.environ.get(STRICT_VARIABLE, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{STRICT_VARIABLE}={raw!r}: expected 1 (a failed check raises) or 0 (it prints a note)")
    return raw == "1"


def _short(values, limit: int = 400) -> str:
    text = ", ".join(repr(v) for v in values) if values else "none recorded"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check(name: str, condition, *values) -> bool:
    """Check one claim of a chapter, named `name` (`"ch07/target-kl#2"`: page, section, number).

    `condition` is the claim's truth in this run (anything `bool()` takes, a one-element tensor
    too); `values` are what the run gave, shown when it does not hold. Returns the truth.

    With `PPO_LAB_BOOK_STRICT=1` (the book build, `make test`) a false claim raises
    `AssertionError`; otherwise it prints one note naming the claim and the values and the
    notebook goes on. With `PPO_LAB_BOOK_CHECK_LOG=FILE` each call also appends one JSON line
    `{"name", "passed", "values"}` to FILE (the sweep reads them).
    """
    passed = bool(condition) and os.environ.get(FAIL_CHECK_VARIABLE, "") != name
    log = os.environ.get(CHECK_LOG_VARIABLE, "")
    if log:
        import json

        with open(log, "a") as f:
            f.write(json.dumps({"name": name, "passed": passed, "values": None if passed else _short(values)}) + "\n")
    if passed:
        return True
    if _strict():
        raise AssertionError(f"check {name} failed: {_short(values)}")
    print(
        f"Note: the claim checked by {name} did not hold in this run (values: {_short(values)}). "
        f"The book's claims were checked over {SWEEP_SEEDS} seeds (book/sweep.md); this run fell "
        "outside them, so read that claim against this run's own numbers. The notebook goes on."
    )
    return False
