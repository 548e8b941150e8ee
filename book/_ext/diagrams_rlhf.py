"""Concept diagrams of chapters 8 to 10: the reward model's loss, the sampler beside the trainer,
and the critic-free estimators.

As in `diagrams_ppo.py`, what a diagram shows that `ppo_lab` computes is computed by `ppo_lab`:
the Bradley-Terry loss, its gradient and its indifference to a common offset by autograd through
`bradley_terry_loss`; the ratios, weights and gap metrics of a made-up response by `log_ratios`,
`correction_weights` and `gap_metrics`; the advantages of two made-up groups by
`compute_advantages`, each checked against the baseline and the scale the figure prints. Every
function, tensor and setting name printed is looked up in the package first (a renamed one stops
the build with its name). One function per diagram, each returning a matplotlib Figure:

    bradley_terry      chapter 8   one preference pair through one reward model, to the loss; the loss and its gradient
    sampler_trainer    chapter 9   one iteration with a separate sampler: the log-prob gap, the correction, the weight sync
    group_advantages   chapter 10  the advantages six estimators give the same two groups of responses
"""

from __future__ import annotations

import dataclasses
import math

from diagram_kit import (BLUE, FONT, FUNCTION_FILL, GREY, INK, PAD, VERMILION, arrow, box, canvas, polyline, ppo_lab_package, require,
                         require_arguments, setting)
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

# pale tints of the kit's blue and vermilion, for cells that carry a sign
BLUE_TINT, VERMILION_TINT = (0.0, 0.447, 0.698), (0.835, 0.369, 0.0)


def _minus(x: float, fmt: str) -> str:
    """`x` formatted with a typographic minus sign, as the axes' tick labels have it."""
    return format(x, fmt).replace("-", "\u2212")


def _tint(rgb, strength: float):
    """`rgb` mixed into white: strength 0 is white, 1 a pale tint (never dark enough to hide ink)."""
    s = 0.45 * max(0.0, min(1.0, strength))
    return tuple(1.0 - s * (1.0 - c) for c in rgb)


# --- chapter 8: the Bradley-Terry loss ------------------------------------------------------


def bradley_terry() -> Figure:
    """One preference pair scored by the one reward model, the difference of the two scores, its
    sigmoid (the probability that the chosen response is preferred) and the loss, all from
    `bradley_terry_loss`; beside it the loss and its gradient against the difference, by autograd
    through the same function, and the same pair with a constant added to both scores."""
    import torch

    ppo_lab_package()
    from ppo_lab import rewards as rewards_module
    from ppo_lab.plotting import TRAINED_COLOR
    from ppo_lab.reward_model import bradley_terry_loss

    require_arguments(bradley_terry_loss, "chosen_scores", "rejected_scores")
    require(hasattr(rewards_module, "sequence_scores"), "ppo_lab.rewards has no 'sequence_scores', which bradley_terry names")

    def loss_and_grads(chosen: float, rejected: float):
        c = torch.tensor([chosen], dtype=torch.float64, requires_grad=True)
        r = torch.tensor([rejected], dtype=torch.float64, requires_grad=True)
        loss, metrics = bradley_terry_loss(c, r)
        loss.backward()
        return loss.item(), c.grad.item(), r.grad.item(), metrics

    r_w, r_l, offset = 1.3, 0.4, 5.0
    loss, g_w, g_l, metrics = loss_and_grads(r_w, r_l)
    margin = metrics["reward_model/margin"].item()
    require(abs(margin - (r_w - r_l)) < 1e-9, "reward_model/margin is not chosen - rejected")
    p = 1.0 / (1.0 + math.exp(-margin))
    require(abs(loss + math.log(p)) < 1e-9, "bradley_terry_loss is not -log sigmoid(chosen - rejected)")
    require(abs(g_w + g_l) < 1e-12 and abs(g_w + (1 - p)) < 1e-9, "the gradient of bradley_terry_loss is not -(1 - sigmoid) on chosen, the opposite on rejected")
    shifted, *_ = loss_and_grads(r_w + offset, r_l + offset)
    require(abs(shifted - loss) < 1e-12, "bradley_terry_loss changes when a constant is added to both scores")

    fig, ax, top = canvas(10.0, 4.8)
    h = 7.0
    y_w, y_l, y_loss = 35.5, 20.0, 5.5  # the chosen and the rejected rows, the loss
    ix, iw = 1.0, 12.5  # inputs
    mx, mw = 16.5, 16.0  # the reward model
    sx, sw = 35.5, 10.5  # the scores
    fx, fw = 50.0, 15.0  # difference, sigmoid, loss
    ax.text(ix, top - 2.5, "one preference pair, through bradley_terry_loss(chosen_scores, rejected_scores)", ha="left", va="center",
            fontsize=FONT, color=GREY, gid="title:flow")
    box(ax, ix, y_w - h / 2, iw, h, "prompt $x$\n+ chosen $y_w$", gid="in:chosen")
    box(ax, ix, y_l - h / 2, iw, h, "prompt $x$\n+ rejected $y_l$", gid="in:rejected")
    box(ax, mx, y_l - h / 2, mw, y_w - y_l + h, "reward model $R_\\psi$\n\none model: the same\nweights score both\nresponses, each read\nat its EOS token",
        fill=TRAINED_COLOR, gid="model")
    for y in (y_w, y_l):
        arrow(ax, (ix + iw, y), (mx, y))
    box(ax, sx, y_w - h / 2, sw, h, f"$R_w$ = {r_w:+.2f}", gid="score:chosen")
    box(ax, sx, y_l - h / 2, sw, h, f"$R_l$ = {r_l:+.2f}", gid="score:rejected")
    for y in (y_w, y_l):
        arrow(ax, (mx + mw, y), (sx, y))
    box(ax, fx, y_w - h / 2, fw, h, f"difference\n$R_w - R_l$ = {margin:.2f}", gid="fn:difference")
    box(ax, fx, y_l - h / 2, fw, h, f"$\\sigma(R_w - R_l)$ = {p:.2f}\n= $\\Pr(y_w \\succ y_l)$", gid="fn:sigmoid")
    box(ax, fx, y_loss - h / 2, fw, h, f"loss $-\\log\\sigma(R_w - R_l)$\n= {loss:.3f}", fill=FUNCTION_FILL, edge=VERMILION, lw=1.6, gid="fn:loss")
    arrow(ax, (sx + sw, y_w), (fx, y_w))
    polyline(ax, [(sx + sw, y_l), (sx + sw + 2.0, y_l), (sx + sw + 2.0, y_w - 2.0), (fx, y_w - 2.0)])
    arrow(ax, (fx + fw / 2, y_w - h / 2), (fx + fw / 2, y_l + h / 2))
    arrow(ax, (fx + fw / 2, y_l - h / 2), (fx + fw / 2, y_loss + h / 2))
    box(ax, ix, y_loss - h / 2 - 0.5, sx + sw - ix, h + 1.0,
        f"the same pair with {offset:g} added to both scores: $R_w$ = {r_w + offset:.2f}, $R_l$ = {r_l + offset:.2f},\n"
        f"difference {margin:.2f}, loss {shifted:.3f}: only differences of scores count",
        ls="--", edge=GREY, gid="note:offset")

    # the loss and its gradient against the difference, by autograd through bradley_terry_loss
    diffs = torch.linspace(-5.0, 5.0, 201, dtype=torch.float64)
    losses, grads = [], []
    for d in diffs.tolist():
        value, gw, _, _ = loss_and_grads(d, 0.0)
        losses.append(value)
        grads.append(gw)
    require(all(a >= b for a, b in zip(losses, losses[1:])) and all(-1 < g < 0 for g in grads), "the loss does not fall, or its gradient leaves (-1, 0)")
    pl = fig.add_axes((0.715, 0.14, 0.275, 0.75))
    pl.axhline(0.0, color="0.75", lw=0.8)
    pl.axvline(0.0, color="0.75", lw=0.8)
    pl.plot(diffs, losses, color=BLUE, lw=2.2, label="loss")
    pl.plot(diffs, grads, color=VERMILION, lw=2.0, ls="--", label="$\\partial$ loss / $\\partial R_w$")
    pl.plot([margin], [loss], "o", color=BLUE, ms=6, zorder=5)
    pl.plot([margin], [g_w], "o", color=VERMILION, ms=6, zorder=5)
    pl.set_xlim(-5, 5)
    pl.set_ylim(-2.0, 5.3)
    pl.tick_params(labelsize=FONT)
    pl.set_xlabel("difference $R_w - R_l$", fontsize=FONT)
    pl.set_title("the loss and its gradient", fontsize=FONT)
    pl.legend(fontsize=FONT, loc="upper right", framealpha=1.0, edgecolor="0.8")
    pl.text(-4.7, -0.72, "ranked wrong:\nfull push", ha="left", va="bottom", fontsize=FONT, color=INK, gid="plot:wrong", linespacing=1.3)
    pl.text(4.8, 0.45, "ranked right:\nlittle push", ha="right", va="bottom", fontsize=FONT, color=INK, gid="plot:right", linespacing=1.3)
    pl.text(4.8, -1.9, f"here {_minus(g_w, '.2f')}: a step raises\n$R_w$ and lowers $R_l$ as much", ha="right", va="bottom", fontsize=FONT,
            color=VERMILION, gid="plot:here", linespacing=1.3)
    return fig


# --- chapter 9: the sampler is not the trainer ----------------------------------------------


def sampler_trainer() -> Figure:
    """One iteration with a separate sampler: it returns its own log-probs with the tokens, the
    trainer's forward recomputes them, their ratio is the gap, `correction_weights` truncates or
    masks it into per-token weights on the loss, and the updated weights go back to the sampler.
    Below, one made-up response of six tokens: its ratios (`log_ratios`), its weights under
    both corrections (`correction_weights`, at the default `sampler.correction_high` and the
    chapter's lower bound of 0.5) and its gap metrics (`gap_metrics`)."""
    import torch

    ppo_lab = ppo_lab_package()
    from ppo_lab.batch import Rollout
    from ppo_lab.config_groups import Sampler as SamplerGroup
    from ppo_lab.plotting import TRAINED_COLOR
    from ppo_lab.rollout_correction import CORRECTIONS, LEVELS, correction_weights, gap_metrics, log_ratios

    fields = {f.name for f in dataclasses.fields(Rollout)}
    for name in ("response_ids", "old_logprobs", "sampler_logprobs"):
        require(name in fields, f"Rollout has no field {name!r}, which sampler_trainer draws")
    for fn in (correction_weights, gap_metrics):
        require_arguments(fn, "old_logprobs", "sampler_logprobs", "mask")
    require(set(CORRECTIONS) >= {"tis", "mis"} and set(LEVELS) >= {"token", "sequence"}, "the corrections are no longer tis and mis, token and sequence")
    for name in ("correction", "correction_level", "correction_low", "correction_high", "noise", "precision", "old_logprobs_from"):
        setting(SamplerGroup, name)
    require(hasattr(ppo_lab, "sampler") and hasattr(ppo_lab.sampler, "Sampler"), "ppo_lab.sampler has no Sampler")
    key = SamplerGroup.key  # "sampler"
    high = setting(SamplerGroup, "correction_high").default
    low = 0.5  # the chapter's MIS band is [0.5, 2]; the setting's default (0) masks nothing below

    # one response of six tokens: the sampler's log-probs, and the trainer's of the same tokens
    sampler_logprobs = torch.tensor([[-0.50, -1.20, -3.10, -0.05, -0.60, -2.00]], dtype=torch.float64)
    old_logprobs = torch.tensor([[-0.48, -1.23, -2.15, -0.05, -1.52, -1.90]], dtype=torch.float64)
    mask = torch.ones_like(old_logprobs)
    rho = log_ratios(old_logprobs, sampler_logprobs, mask).exp()
    require(torch.allclose(rho, (old_logprobs - sampler_logprobs).exp()), "log_ratios is not log pi_old - log pi_s")
    tis = correction_weights(old_logprobs, sampler_logprobs, mask, kind="tis", high=high)
    mis = correction_weights(old_logprobs, sampler_logprobs, mask, kind="mis", low=low, high=high)
    require(torch.allclose(tis, rho.clamp(max=high)), "tis is not min(rho, high)")
    require(torch.allclose(mis, torch.where((rho >= low) & (rho <= high), rho, torch.zeros_like(rho))), "mis is not rho inside [low, high], 0 outside")
    seq = correction_weights(old_logprobs, sampler_logprobs, mask, kind="tis", level="sequence", high=high)
    require(torch.allclose(seq, rho.prod().expand_as(rho)) and bool((seq < high).all()), "the sequence-level weight is not the product of the ratios")
    metrics = {kind: gap_metrics(old_logprobs, sampler_logprobs, mask, w, kind=kind) for kind, w in (("tis", tis), ("mis", mis))}
    kl, ess = metrics["tis"]["sampler/kl"].item(), metrics["tis"]["sampler/ess"].item()
    n = mask.shape[1]
    changed = {kind: round(metrics[kind]["sampler/corrected_frac"].item() * n) for kind in metrics}

    fig, ax, top = canvas(10.0, 6.6)
    h = 8.0
    y1, y2 = top - 5.5, top - 23.0  # the two rows of the loop
    # top row: prompts -> the sampler -> tokens and its log-probs -> the trainer's forward -> old_logprobs
    box(ax, 1.0, y1 - h / 2, 9.0, h, "prompts", gid="prompts")
    ex, ew = 13.0, 21.0
    box(ax, ex, y1 - h / 2, ew, h, "sampler $\\pi_s$: an inference\nengine (vLLM, SGLang), its\nown kernels, often bf16", fill="#dbe9f6", gid="sampler")
    arrow(ax, (10.0, y1), (ex, y1))
    tx, tw = 37.5, 17.0
    box(ax, tx, y1 - h / 2, tw, h, "response_ids\nsampler_logprobs\n(B, T)", mono=True, gid="tensor:sampled")
    arrow(ax, (ex + ew, y1), (tx, y1))
    fx, fw = 58.0, 19.0
    box(ax, fx, y1 - h / 2, fw, h, "trainer's forward $\\pi_{\\mathrm{old}}$:\nthe same weights,\nother numerics", fill=TRAINED_COLOR, gid="trainer")
    arrow(ax, (tx + tw, y1), (fx, y1))
    ox, ow = 81.0, 18.0
    box(ax, ox, y1 - h / 2, ow, h, "old_logprobs\n(B, T)", mono=True, gid="tensor:old")
    arrow(ax, (fx + fw, y1), (ox, y1))
    # bottom row, right to left: the correction -> the update -> the weights back to the sampler
    cx, cw = 73.0, 26.0
    box(ax, cx, y2 - h / 2, cw, h, "correction_weights\n$w_t = \\pi_{\\mathrm{old}} / \\pi_s$ per token,\ntruncated (tis) or masked (mis)", fill=FUNCTION_FILL, gid="fn:correction")
    arrow(ax, (ox + ow / 2 + 3.0, y1 - h / 2), (ox + ow / 2 + 3.0, y2 + h / 2))
    polyline(ax, [(tx + tw / 2, y1 - h / 2), (tx + tw / 2, (y1 + y2) / 2), (cx + 4.0, (y1 + y2) / 2), (cx + 4.0, y2 + h / 2)])
    ux, uw = 37.5, 31.0
    box(ax, ux, y2 - h / 2, uw, h, "PPO update: each token's loss\n$\\times$ its weight $\\tilde w_t$, ratio and clip\nagainst $\\pi_{\\mathrm{old}}$ (ch. 6)", fill=TRAINED_COLOR, gid="update")
    arrow(ax, (cx, y2), (ux + uw, y2))
    polyline(ax, [(ux, y2), (ex + ew / 2, y2), (ex + ew / 2, y1 - h / 2)], color=VERMILION, lw=1.6)
    ax.text(ex + ew / 2 + 1.2, (y1 - h / 2 + y2) / 2 + 1.0, "weight sync\nafter every\nupdate", ha="left", va="center", fontsize=FONT,
            color=VERMILION, gid="label:sync", linespacing=1.3)
    ax.text(1.0, y1 - h / 2 - 1.8, f"ppo_lab's stand-ins for\nan engine: {key}.noise\n(a perturbed copy),\n{key}.precision (bf16)", ha="left",
            va="top", fontsize=FONT, color=GREY, gid="note:ppo_lab", linespacing=1.3)

    # the numbers of one response
    lx, x0, cwid, ch = 1.0, 37.5, 10.25, 4.2
    y_head = y2 - h / 2 - 4.5
    ax.text(lx, y_head, "one response of six tokens", ha="left", va="center", fontsize=FONT, color=INK, weight="bold", gid="table:title")
    for t in range(n):
        ax.text(x0 + (t + 0.5) * cwid, y_head, f"t = {t + 1}", ha="center", va="center", fontsize=FONT, color=INK, gid=f"head:{t}")
    rows = [
        ("sampler", "$\\log\\pi_s$ (sampler_logprobs)", sampler_logprobs, None),
        ("old", "$\\log\\pi_{\\mathrm{old}}$ (old_logprobs)", old_logprobs, None),
        ("rho", "gap $w_t = \\pi_{\\mathrm{old}} / \\pi_s$", rho, None),
        ("tis", f"tis: $\\tilde w_t = \\min(w_t, {high:g})$", tis, rho),
        ("mis", f"mis: $\\tilde w_t = w_t$ in [{low:g}, {high:g}], else 0", mis, rho),
    ]
    for i, (gid, label, values, before) in enumerate(rows):
        y = y_head - 2.8 - (i + 1) * ch
        ax.text(lx, y + ch / 2, label, ha="left", va="center", fontsize=FONT, color=INK, gid=f"label:{gid}")
        for t in range(n):
            v = values[0, t].item()
            hit = before is not None and abs(v - before[0, t].item()) > 1e-9  # truncated or masked here
            far = gid == "rho" and not low <= v <= high
            fill = _tint(VERMILION_TINT, 0.6) if hit or far else "white"
            ax.add_patch(Rectangle((x0 + t * cwid, y), cwid, ch, fc=fill, ec="0.6", lw=0.8))
            ax.text(x0 + (t + 0.5) * cwid, y + ch / 2, _minus(v, ".2f"), ha="center", va="center", fontsize=FONT, family="monospace",
                    color=INK, gid=f"{gid}:{t}")
    y_note = y_head - 2.8 - len(rows) * ch - 1.8
    ax.text(lx, y_note,
            f"Shaded: a ratio outside [{low:g}, {high:g}], and the weights a correction changed ({key}/corrected_frac = {changed['tis']}/{n} "
            f"with tis, {changed['mis']}/{n} with mis).\n"
            f"gap_metrics: {key}/kl = {kl:.3f} nats per token, {key}/ess = {ess:.2f}. With {key}.correction_level = \"sequence\", "
            f"all six tokens\nwould get one weight, the product $w_1 \\cdots w_{n}$ = {seq[0, 0].item():.2f}.",
            ha="left", va="top", fontsize=FONT, color=INK, gid="note:metrics", linespacing=1.4)
    return fig


# --- chapter 10: the critic-free estimators on the same groups ------------------------------

# Each estimator of the chapter's table, with the baseline b_i and the scale sigma_i the figure
# prints for it; `group_advantages` checks each against what `compute_advantages` returns.
ESTIMATOR_ROWS = [
    ("rloo", "$b_i$ = mean of the other responses, $\\sigma_i$ = 1"),
    ("grpo", "$b_i$ = group mean, $\\sigma_i$ = group std"),
    ("dr_grpo", "$b_i$ = group mean, $\\sigma_i$ = 1"),
    ("reinforce", "$b_i$ = batch mean, $\\sigma_i$ = 1"),
    ("reinforce_pp", "$b_i$ = batch mean, $\\sigma_i$ = batch std"),
    ("reinforce_pp_baseline", "$b_i$ = group mean, then batch mean; $\\sigma_i$ = batch std"),
]


def group_advantages() -> Figure:
    """The advantage each critic-free estimator gives the same batch: two prompts with four
    responses each, one prompt answered right once, the other every time. The advantages come
    from `compute_advantages`; each row's baseline and scale, as printed, are recomputed here
    by hand and must agree with it."""
    import torch

    ppo_lab_package()
    from ppo_lab.estimators import ADVANTAGE_ESTIMATORS, compute_advantages

    require_arguments(compute_advantages, "name", "rewards", "mask")
    G, T = 4, 3  # responses per prompt, tokens per response
    scores = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)  # 1 = right
    group_ids = torch.tensor([0] * G + [1] * G)
    mask = torch.ones(2 * G, T, dtype=torch.float64)
    rewards = torch.zeros(2 * G, T, dtype=torch.float64)
    rewards[:, -1] = scores  # the score on the last token, no KL
    advantages = {}
    for name, _ in ESTIMATOR_ROWS:
        require(name in ADVANTAGE_ESTIMATORS, f"there is no advantage estimator {name!r}, which group_advantages draws")
        adv, _ = compute_advantages(name, rewards, mask, group_ids=group_ids, scores=scores, gamma=1.0)
        require(bool((adv == adv[:, :1]).all()), f"{name} gives the tokens of one response different advantages here")
        advantages[name] = adv[:, 0]

    # the printed baselines and scales, by hand
    groups = scores.view(2, G)
    group_mean = groups.mean(1).repeat_interleave(G)
    others = ((groups.sum(1, keepdim=True) - groups) / (G - 1)).flatten()
    group_std = groups.std(1).repeat_interleave(G)  # unbiased, as GRPO's
    tokens = scores.repeat_interleave(T)  # the batch statistics are over real tokens (all responses are T long)

    def batch_whiten(x):
        xt = x.repeat_interleave(T)
        return (x - xt.mean()) / xt.std()

    expect = {
        "rloo": scores - others,
        "grpo": (scores - group_mean) / (group_std + 1e-6),
        "dr_grpo": scores - group_mean,
        "reinforce": scores - tokens.mean(),
        "reinforce_pp": batch_whiten(scores),
        "reinforce_pp_baseline": batch_whiten(scores - group_mean),
    }
    for name, _ in ESTIMATOR_ROWS:
        require(torch.allclose(advantages[name], expect[name], atol=1e-4), f"{name}'s advantages are not the baseline and scale drawn for it")
    shrink = advantages["dr_grpo"][:G] / advantages["rloo"][:G]
    require(torch.allclose(shrink, torch.full((G,), (G - 1) / G, dtype=torch.float64)), "Dr. GRPO is not (N - 1) / N of RLOO in group A")
    group_baselines = ("rloo", "grpo", "dr_grpo", "reinforce_pp_baseline")
    require(all(bool((advantages[name][G:] == 0).all()) for name in group_baselines) and bool((advantages["reinforce"][G:] > 0).all()),
            "the group baselines do not give prompt B 0, or reinforce's batch baseline does not give it more")

    fig, ax, top = canvas(10.0, 6.0)
    lx, x0, cw, gap, ch = 1.0, 41.0, 6.6, 3.0, 5.2
    xs = [x0 + i * cw + (gap if i >= G else 0.0) for i in range(2 * G)]
    ax.text(lx, top - 2.6, "$\\hat A_i = (R_i - b_i)\\,/\\,\\sigma_i$ for every token of response $i$, from compute_advantages(name, rewards, mask, ...)",
            ha="left", va="center", fontsize=FONT + 1, color=INK, gid="title")
    ax.text(lx, top - 6.2, f"one batch: two prompts, {G} responses each, a score of 1 (right) or 0 on the last of {T} tokens, no KL term",
            ha="left", va="center", fontsize=FONT, color=GREY, gid="subtitle")
    y_group = top - 10.5
    right = [int(groups[k].sum().item()) for k in range(2)]
    for k, label in enumerate(("A", "B")):
        cx = (xs[k * G] + xs[k * G + G - 1] + cw) / 2
        ax.text(cx, y_group, f"prompt {label}: {right[k]} of {G} right", ha="center", va="center", fontsize=FONT, weight="bold", color=INK,
                gid=f"group:{label}")
    y = y_group - 2.5 - ch
    ax.text(lx, y + ch / 2, "score $R_i$", ha="left", va="center", fontsize=FONT, color=INK, gid="label:scores")
    for i, x in enumerate(xs):
        ax.add_patch(Rectangle((x, y), cw, ch, fc=PAD, ec="0.6", lw=0.8))
        ax.text(x + cw / 2, y + ch / 2, f"{scores[i].item():.0f}", ha="center", va="center", fontsize=FONT, family="monospace",
                weight="bold", color=INK, gid=f"score:{i}")
    y -= 1.5
    for name, formula in ESTIMATOR_ROWS:
        y -= ch + (1.2 if name == "reinforce" else 0.0)  # the group baselines above, the batch's below
        a = advantages[name]
        biggest = a.abs().max().item()
        ax.text(lx, y + ch / 2 + 1.15, name, ha="left", va="center", fontsize=FONT, family="monospace", weight="bold", color=INK, gid=f"name:{name}")
        ax.text(lx, y + ch / 2 - 1.25, formula, ha="left", va="center", fontsize=FONT, color=GREY, gid=f"formula:{name}")
        for i, x in enumerate(xs):
            v = a[i].item()
            fill = "white" if abs(v) < 1e-9 else _tint(BLUE_TINT if v > 0 else VERMILION_TINT, abs(v) / biggest)
            ax.add_patch(Rectangle((x, y), cw, ch, fc=fill, ec="0.6", lw=0.8))
            ax.text(x + cw / 2, y + ch / 2, _minus(v + 0.0, "+.2f") if abs(v) > 1e-9 else "0", ha="center", va="center", fontsize=FONT,
                    family="monospace", color=INK, gid=f"{name}:{i}")
    b_batch = advantages["reinforce"][G].item()
    ax.text(lx, y - 2.2,
            f"Prompt B, right every time, gets 0 from each group baseline (nothing to beat; DAPO's dynamic sampling drops such groups)\n"
            f"and {_minus(b_batch, '+.2f')} from reinforce's batch baseline. Dr. GRPO is {G - 1}/{G} of RLOO, $(N-1)/N$: the direction kept, the step shrunk.",
            ha="left", va="top", fontsize=FONT, color=INK, gid="note", linespacing=1.4)
    return fig


DIAGRAMS = {"bradley_terry": bradley_terry, "sampler_trainer": sampler_trainer, "group_advantages": group_advantages}
