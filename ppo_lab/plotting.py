"""The standard PPO training dashboard, from `metrics.jsonl` files.

Chapter 7 (The PPO trainer end to end) reads its first runs with it. Six panels, the metrics to
look at first when a run misbehaves: the score (is it learning?), the KL to the reference (is it
drifting?), the entropy (is it collapsing?), the clip fraction (are updates too large?), the
explained variance (is the critic useful?) and the response length (is it gaming the reward
with length?). Several runs are drawn side by side on the same axes.
"""

from __future__ import annotations

import json
from pathlib import Path

DASHBOARD = (
    ("reward/score_mean", "score"),
    ("objective/kl", "KL to reference (nats / response)"),
    ("objective/entropy", "entropy (nats / token)"),
    ("policy/clipfrac", "clip fraction"),
    ("value/explained_variance", "explained variance"),
    ("response/length_mean", "response length (tokens)"),
)


def load_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl file (or of `<folder>/metrics.jsonl`)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        raise ValueError(f"no metrics file at {str(path)!r}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{str(path)!r} holds no metrics")
    return rows


def plot_dashboard(runs, labels=None, metrics=DASHBOARD, smooth: int = 1, ncols: int = 3):
    """Draw the dashboard; returns the matplotlib Figure.

    Args:
        runs: a metrics.jsonl path, a run folder, a list of metric dicts, or a list of any of
            these (one line per run).
        labels: legend label per run (default: the file's folder name, or "run i").
        metrics: (name, title) pairs, one panel each.
        smooth: width of a trailing moving average (1 = raw values).
    """
    import matplotlib.pyplot as plt

    if isinstance(runs, (str, Path)) or (isinstance(runs, list) and runs and isinstance(runs[0], dict)):
        runs = [runs]
    loaded, names = [], []
    for i, run in enumerate(runs):
        if isinstance(run, (str, Path)):
            loaded.append(load_metrics(run))
            p = Path(run)
            names.append(p.name if p.is_dir() else p.parent.name)
        else:
            loaded.append(list(run))
            names.append(f"run {i + 1}")
    labels = list(labels) if labels is not None else names
    nrows = -(-len(metrics) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 2.9 * nrows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, metrics):
        for rows, label in zip(loaded, labels):
            xs = [r.get("iteration", i + 1) for i, r in enumerate(rows) if r.get(key) is not None]
            ys = [r[key] for r in rows if r.get(key) is not None]
            if smooth > 1 and ys:
                ys = [sum(ys[max(0, i - smooth + 1) : i + 1]) / len(ys[max(0, i - smooth + 1) : i + 1]) for i in range(len(ys))]
            ax.plot(xs, ys, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.set_visible(False)
    if len(loaded) > 1:
        axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    return fig
