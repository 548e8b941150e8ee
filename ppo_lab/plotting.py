"""The standard PPO training dashboard, from `metrics.jsonl` files; and one rollout, drawn.

`rollout_diagram` draws the tensors of one real rollout beside the models that produced them
(chapter 1, RL for language models).

The dashboard (chapter 7, The PPO trainer end to end, reads its first runs with it) has six
panels, the metrics to look at first when a run misbehaves: the score (is it learning?), the KL
to the reference (is it drifting?), the entropy (is it collapsing?), the clip fraction (are
updates too large?), the explained variance (is the critic useful?) and the response length (is
it gaming the reward with length?). Several runs are drawn side by side on the same axes.
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


# --- chapter 1: one rollout, drawn ----------------------------------------------------------
TRAINED_COLOR, FROZEN_COLOR = "#f4c38b", "#c9d6e6"  # the fills of the trained and the frozen models


def _shape(tensor) -> str:
    """`(64, 9)` for a (64, 9) tensor, `(64,)` for a (64,) one: Python's tuple notation."""
    return str(tuple(tensor.shape))


def _fit(text, renderer, max_px: float, min_size: float = 7.0) -> None:
    """Shrink a matplotlib Text until it is at most `max_px` wide, down to `min_size` points; if
    it is still too wide, cut its end, marked with an ellipsis (a long token, a long prompt)."""
    size = text.get_fontsize()
    while text.get_window_extent(renderer).width > max_px and size > min_size:
        size = max(min_size, min(0.95 * size, size * max_px / text.get_window_extent(renderer).width))
        text.set_fontsize(size)
    content = text.get_text()
    while text.get_window_extent(renderer).width > max_px and len(content) > 2:
        content = content[:-1]
        text.set_text(content.rstrip() + "\u2026")


def rollout_diagram(*, prompt: str, tokens: list[str], response_ids, mask, old_logprobs, ref_logprobs, values, scores,
                    rewards, advantages, returns, query_ids=None, row: int = 0, kl_coef: float | None = None,
                    reward_name: str | None = None, estimator: str = "GAE", whitened: bool = True, kl_estimator: str = "k1",
                    max_columns: int = 12):
    """Draw one rollout through the four models, from its real tensors; returns the Figure.

    Left, the models, filled by whether the update trains them (policy, critic) or not
    (reference, reward); middle, the tensor each one produces, with its real shape; right, the
    tensor's values for one response of the batch (`row`), a column per response token (grey
    where `mask` is 0, padding). The last three rows (rewards, advantages, returns) are computed
    from the rows above them by no model; dashed arrows carry the advantages into the policy's
    loss and the returns into the critic's, the only two models the update changes.

    Every tensor is the whole batch's; the values drawn are `tensor[row, :max_columns]`.

    Args:
        prompt: the prompt of `row`, as text.
        tokens: the response tokens of `row` as strings, one per column (`T` of them, padding
            included), e.g. `tokenizer.convert_ids_to_tokens(response_ids[row])`.
        response_ids, mask, old_logprobs, ref_logprobs, rewards, advantages, returns: (B, T).
        values: (B, T), or None for a rollout without a critic (its box and row are left out).
        scores: (B,) the reward's score of each response.
        query_ids: (B, P) the prompts' tokens (optional: only its shape is drawn).
        row: the response of the batch whose values are drawn.
        kl_coef: beta of the KL penalty, named in the rewards row (optional).
        kl_estimator: the per-token KL estimator the rewards were shaped with (k1 is written out).
        reward_name: what the reward is, written in its box (optional).
        estimator: the advantage estimator's name, written in the advantages row.
        whitened: whether the advantages were whitened (said in their row).
        max_columns: at most this many response positions are drawn.

    Each tensor's label is one text, `"<name> <shape>"` (`"old_logprobs (64, 9)"`), with gid
    `"<name>:label"`; each value drawn has gid `"<name>:<t>"` (t from 0), for tests to read.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

    T = response_ids.shape[1]
    cols = min(T, max_columns)
    beta = f"{kl_coef:g}" if kl_coef is not None else "beta"
    # (name, tensor, how its values print, the note under its label), top to bottom
    penalty = "(\\log\\pi_{old} - \\log\\pi_{ref})" if kl_estimator == "k1" else f"\\mathrm{{KL}}_{{{kl_estimator}}}"
    rows = [
        ("response_ids", response_ids, "{:d}", "the sampled tokens $a_t$"),
        ("mask", mask, "{:d}", "1 up to and including the EOS"),
        ("old_logprobs", old_logprobs, "{:+.2f}", "$\\log\\pi_{old}(a_t \\mid s_t)$"),
        ("ref_logprobs", ref_logprobs, "{:+.2f}", "$\\log\\pi_{ref}(a_t \\mid s_t)$"),
        ("values", values, "{:+.2f}", "$V(s_t)$, the expected return"),
        ("scores", scores, "{:+.2f}", "$R(x, y)$, one number per response"),
        ("rewards", rewards, "{:+.2f}", f"score at the EOS $-\\ {beta}\\,{penalty}$"),
        ("advantages", advantages, "{:+.2f}", f"{estimator}(rewards, values)" + (", whitened" if whitened else "")),
        ("returns", returns, "{:+.2f}", "the critic's targets"),
    ]
    rows = [r for r in rows if r[1] is not None]
    y = {name: i + 1.5 for i, (name, *_) in enumerate(rows)}  # row centres; the header (prompt, tokens) sits above 1
    n_rows = len(rows) + 1

    fig_width = 11.0
    fig, ax = plt.subplots(figsize=(fig_width, 0.58 * n_rows + 1.3))
    ax.set_xlim(0, 100)
    ax.set_ylim(n_rows + 0.1, -0.3)  # row 0 (the header) on top
    ax.axis("off")

    # models: (name, lines, rows it produces, trained?)
    models = [
        ("policy", "policy $\\pi_\\theta$ (actor)\nsamples $y$ given $x$", ["response_ids", "mask", "old_logprobs"], True),
        ("reference", "reference $\\pi_{ref}$", ["ref_logprobs"], False),
        ("critic", "critic $V_\\phi$", ["values"], True),
        ("reward", f"reward: {reward_name}" if reward_name else "reward $R$", ["scores"], False),
    ]
    box_x0, box_x1, label_x0, grid_x0, grid_x1 = 3.0, 19.5, 21.5, 46.5, 99.5
    box_of = {}
    for name, text, produced, trained in models:
        produced = [p for p in produced if p in y]
        if not produced:
            continue
        top, bottom = y[produced[0]] - 0.42, y[produced[-1]] + 0.42
        ax.add_patch(FancyBboxPatch((box_x0, top), box_x1 - box_x0, bottom - top, boxstyle="round,pad=0,rounding_size=0.8",
                                    fc=TRAINED_COLOR if trained else FROZEN_COLOR, ec="0.25", lw=1.0, mutation_aspect=0.1))
        middle = (top + bottom) / 2
        ax.text((box_x0 + box_x1) / 2, middle - 0.05, text, ha="center", va="bottom", fontsize=9.5, gid=f"{name}:box")
        ax.text((box_x0 + box_x1) / 2, middle + 0.05, "trained" if trained else "frozen", ha="center", va="top", fontsize=9.5,
                weight="bold", gid=f"{name}:status")
        box_of[name] = (top, bottom)
        for p in produced:
            ax.annotate("", xy=(label_x0 - 0.3, y[p]), xytext=(box_x1, y[p]), arrowprops=dict(arrowstyle="->", color="0.25", lw=1.0))
    ax.text((box_x0 + box_x1) / 2, y["rewards"], "no model: computed\nfrom the rows above", ha="center", va="center",
            fontsize=9.5, style="italic", color="0.3")

    # labels: name and shape, and a note on what the tensor holds
    for name, tensor, _, note in rows:
        ax.text(label_x0, y[name] - 0.12, f"{name} {_shape(tensor)}", ha="left", va="center", fontsize=10,
                family="monospace", weight="bold", gid=f"{name}:label")
        ax.text(label_x0, y[name] + 0.23, note, ha="left", va="center", fontsize=8.5, color="0.25", gid=f"{name}:note")

    # the grid: one column per response position of `row`
    width = (grid_x1 - grid_x0) / cols
    real = mask[row].tolist()
    shown = "" if cols == T else f" (first {cols} of {T} positions)"
    ax.text(label_x0, 0.0, "prompt x" + (f", query_ids {_shape(query_ids)}" if query_ids is not None else ""), ha="left",
            va="center", fontsize=9, color="0.25")
    ax.text(label_x0, 0.6, repr(prompt), ha="left", va="center", fontsize=10, family="monospace", gid="prompt")
    for t in range(cols):
        cx = grid_x0 + (t + 0.5) * width
        ax.text(cx, 0.6, tokens[t], ha="center", va="center", fontsize=10, color="0.45" if not real[t] else "black",
                weight="bold", gid=f"token:{t}")
    ax.text(grid_x0, 0.0, f"response y, row {row} of the batch{shown}; grey: padding (mask 0)", ha="left", va="center",
            fontsize=9, color="0.25")
    for name, tensor, fmt, _ in rows:
        if name == "scores":  # one number for the whole response: one cell across its real tokens
            n_real = int(sum(real[:cols]))
            ax.add_patch(Rectangle((grid_x0, y[name] - 0.38), n_real * width, 0.76, fc="white", ec="0.5", lw=0.8))
            ax.text(grid_x0 + n_real * width / 2, y[name], fmt.format(float(tensor[row])), ha="center", va="center",
                    fontsize=10, gid="scores:0")
            continue
        for t in range(cols):
            value = tensor[row, t].item()
            value = int(value) if fmt == "{:d}" else float(value)
            ax.add_patch(Rectangle((grid_x0 + t * width, y[name] - 0.38), width, 0.76, fc="white" if real[t] else "0.88",
                                   ec="0.6", lw=0.6))
            ax.text(grid_x0 + (t + 0.5) * width, y[name], fmt.format(value), ha="center", va="center", fontsize=10,
                    color="black" if real[t] else "0.45", gid=f"{name}:{t}")

    # the update: advantages into the policy's loss, returns into the critic's (dashed, in the left gutter)
    for source, target, x in (("advantages", "policy", 1.6), ("returns", "critic", 0.6)):
        if source in y and target in box_of:
            ty = (box_of[target][0] + box_of[target][1]) / 2 + (0.25 if target == "policy" else 0.0)
            ax.plot([label_x0 - 0.5, x, x], [y[source], y[source], ty], ls="--", color="#b35900", lw=1.2)
            ax.annotate("", xy=(box_x0, ty), xytext=(x, ty), arrowprops=dict(arrowstyle="->", color="#b35900", lw=1.2, ls="--"))
    handles = [Patch(fc=TRAINED_COLOR, ec="0.25", label="trained by the update"),
               Patch(fc=FROZEN_COLOR, ec="0.25", label="frozen: never updated"),
               Line2D([], [], ls="--", color="#b35900", label="into the update's losses (advantages: policy; returns: critic)")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=9.5, frameon=False)
    fig.tight_layout()
    # texts wider than their room are drawn smaller, measured once the layout is final
    renderer = fig.canvas.get_renderer()
    px = ax.transData.transform((1, 0))[0] - ax.transData.transform((0, 0))[0]  # pixels per x unit
    token_texts = [text for text in ax.texts if (text.get_gid() or "").startswith("token:")]
    room = 0.92 * width * px
    if any(text.get_window_extent(renderer).width > room * 10 / 8.5 for text in token_texts):
        # a token would need less than 8.5 points in its column: stagger the header in two lines,
        # so that each token has two columns' room
        for text in token_texts:
            text.set_y(0.48 if int(text.get_gid().split(":")[1]) % 2 == 0 else 0.84)
        room = 1.9 * width * px
    for text in token_texts:
        _fit(text, renderer, room)
    for text in ax.texts:
        gid = text.get_gid() or ""
        if gid.endswith(":box") or gid.endswith(":status"):
            _fit(text, renderer, 0.94 * (box_x1 - box_x0) * px)
        elif gid == "prompt" or gid.endswith(":label") or gid.endswith(":note"):
            _fit(text, renderer, (grid_x0 - label_x0 - 1.0) * px)
    return fig
