"""Concept diagrams of chapters 1 to 7, the chapter map of the opening page, and appendix A.

Where a diagram shows something `ppo_lab` computes, it is computed by `ppo_lab`: the clip regions
by autograd through `clipped_policy_loss`, the numbers of the GAE recursion by `compute_gae` and
`shape_rewards`, the two KL placements by `shape_rewards` and `ppo_loss`, and every tensor name,
function name and setting printed is looked up in the package first (a renamed one stops the
build with its name). One function per diagram, each returning a matplotlib Figure:

    rlhf_loop        chapter 1  the four models, the tensors between them and the update
    reinforce_flow   chapter 2  REINFORCE: sampled responses, their scores, and the gradient each token gets
    gae_recursion    chapter 4  GAE's backward pass over one padded response
    kl_placement     chapter 5  the KL penalty in the reward or in the loss (`kl.placement`)
    clip_regions     chapter 6  PPO-clip's objective against the ratio, and where the gradient is cut
    trainer_iteration chapter 7 one iteration of PPOTrainer: its phases, its optimizer steps, one step
    chapter_map      opening    the chapters and what each builds on
    score_placement  appendix A which token receives the sequence score, in each implementation
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml
from diagram_kit import (BLUE, DPI, FONT, FUNCTION_FILL, GREEN, GREY, INK, PAD, ROOT, TENSOR_FILL, VERMILION, arrow, box, canvas,
                         polyline, ppo_lab_package, require, require_arguments, setting)
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle


# --- chapter 1: the RLHF loop ---------------------------------------------------------------


def rlhf_loop() -> Figure:
    """The four models of PPO for language models, the tensors of a rollout, and the update.

    The tensor names are fields of `ppo_lab.batch.Rollout` and arguments of the functions drawn,
    which are ppo_lab's; the fills are those of chapter 1's rollout figure (`ppo_lab.plotting`)."""
    ppo_lab = ppo_lab_package()
    from ppo_lab.batch import Rollout
    from ppo_lab.plotting import FROZEN_COLOR, TRAINED_COLOR

    rollout_fields = {f.name for f in dataclasses.fields(Rollout)}
    for name in ("response_ids", "mask", "old_logprobs", "ref_logprobs", "values", "scores"):
        require(name in rollout_fields, f"Rollout has no field {name!r}, which rlhf_loop draws")
    for name in ("generate", "shape_rewards", "compute_gae", "clipped_policy_loss", "clipped_value_loss"):
        require(hasattr(ppo_lab, name), f"ppo_lab has no {name!r}, which rlhf_loop names")
    require_arguments(ppo_lab.shape_rewards, "scores", "logprobs", "ref_logprobs", "mask")
    require_arguments(ppo_lab.compute_gae, "rewards", "values", "mask")
    require_arguments(ppo_lab.clipped_policy_loss, "old_logprobs", "advantages")
    require_arguments(ppo_lab.clipped_value_loss, "values", "returns")

    fig, ax, top = canvas(10.0, 6.3)
    h = 6.4  # box height
    rows = {"policy": 45.5, "reference": 34.5, "reward": 23.5, "critic": 12.5}  # box centres
    models = {
        "policy": ("policy $\\pi_\\theta$ (actor)", TRAINED_COLOR),
        "reference": ("reference $\\pi_{\\mathrm{ref}}$", FROZEN_COLOR),
        "reward": ("reward model $R$", FROZEN_COLOR),
        "critic": ("critic $V_\\phi$", TRAINED_COLOR),
    }
    outputs = {"policy": "old_logprobs\n(B, T)", "reference": "ref_logprobs\n(B, T)", "reward": "scores\n(B,)", "critic": "values\n(B, T)"}
    mx0, mw = 16.5, 17.0  # the models' column
    tx0, tw = 38.0, 13.5  # the tensors' column
    for key, y in rows.items():
        label, fill = models[key]
        box(ax, mx0, y - h / 2, mw, h, label, fill=fill, gid=f"model:{key}")
        box(ax, tx0, y - h / 2, tw, h, outputs[key], mono=True, gid=f"tensor:{key}")
        arrow(ax, (mx0 + mw, y), (tx0, y))

    # sampling: prompts -> policy -> the responses, which all four models read
    box(ax, 1.0, rows["policy"] - h / 2, 11.5, h, "prompts $x$", mono=False, gid="prompts")
    arrow(ax, (12.5, rows["policy"]), (mx0, rows["policy"]))
    ry = (rows["reference"] + rows["reward"]) / 2
    box(ax, 1.0, ry - h / 2 - 1.2, 11.5, h + 2.4, "response_ids\nmask\n(B, T)", mono=True, gid="tensor:responses")
    polyline(ax, [(mx0 + 3.0, rows["policy"] - h / 2), (mx0 + 3.0, rows["policy"] - h / 2 - 2.0), (6.75, rows["policy"] - h / 2 - 2.0), (6.75, ry + h / 2 + 1.2)])
    ax.text(6.9, rows["policy"] - h / 2 - 3.2, "generate", ha="left", va="top", fontsize=FONT, style="italic", color=GREY, gid="label:generate")
    bus = 14.5
    ax.plot([12.5, bus], [ry, ry], color=INK, lw=1.2)
    ax.plot([bus, bus], [rows["critic"], rows["reference"]], color=INK, lw=1.2)
    for key in ("reference", "reward", "critic"):
        arrow(ax, (bus, rows[key]), (mx0, rows[key]))

    # from the rollout to the update's inputs
    sx0, sw = 55.5, 13.0
    s_lo, s_hi = rows["reward"] - h / 2, rows["policy"] + h / 2
    box(ax, sx0, s_lo, sw, s_hi - s_lo, "shape_rewards\n\n$-\\beta\\,$KL on\nevery token,\nscore on\nthe last\n(ch. 5)", fill=FUNCTION_FILL, gid="fn:shape_rewards")
    for key in ("policy", "reference", "reward"):
        arrow(ax, (tx0 + tw, rows[key]), (sx0, rows[key]))
    cx0, cw = 72.5, 13.0
    rw_y = rows["reference"]
    box(ax, cx0, rw_y - h / 2, cw, h, "rewards\n(B, T)", mono=True, gid="tensor:rewards")
    arrow(ax, (sx0 + sw, rw_y), (cx0, rw_y))
    box(ax, cx0, rows["critic"] - h / 2, cw, h, "compute_gae\n(ch. 4)", fill=FUNCTION_FILL, gid="fn:compute_gae")
    arrow(ax, (cx0 + cw / 2, rw_y - h / 2), (cx0 + cw / 2, rows["critic"] + h / 2))
    arrow(ax, (tx0 + tw, rows["critic"]), (cx0, rows["critic"]))
    ax0, aw = 88.5, 10.5
    box(ax, ax0, rows["reward"] - h / 2, aw, h, "advantages\n(B, T)", mono=True, gid="tensor:advantages")
    box(ax, ax0, rows["critic"] - h / 2 - 4.0, aw, h, "returns\n(B, T)", mono=True, gid="tensor:returns")
    arrow(ax, (cx0 + cw, rows["critic"] + 1.5), (ax0, rows["reward"] - 1.0))
    arrow(ax, (cx0 + cw, rows["critic"] - 1.5), (ax0, rows["critic"] - 4.0))

    # the update: the two trained models change, the two frozen ones never do
    up = rows["policy"] + h / 2 + 5.0
    polyline(ax, [(ax0 + aw / 2, rows["reward"] + h / 2), (ax0 + aw / 2, up), (mx0 + mw / 2, up), (mx0 + mw / 2, rows["policy"] + h / 2)], color=VERMILION, lw=1.6)
    ax.text((mx0 + ax0 + aw) / 2 + 8, up + 0.8, "update the policy: clipped policy loss on advantages, ratio to old_logprobs (ch. 6)",
            ha="center", va="bottom", fontsize=FONT, color=VERMILION, gid="label:policy_update")
    down = rows["critic"] - h / 2 - 6.0
    polyline(ax, [(ax0 + aw / 2, rows["critic"] - h / 2 - 4.0), (ax0 + aw / 2, down), (mx0 + mw / 2, down), (mx0 + mw / 2, rows["critic"] - h / 2)], color=VERMILION, lw=1.6)
    ax.text((mx0 + ax0 + aw) / 2 + 8, down + 0.8, "update the critic: value loss, values against returns (ch. 4, 6)",
            ha="center", va="bottom", fontsize=FONT, color=VERMILION, gid="label:critic_update")

    # legend, top left
    legend = [(TRAINED_COLOR, "trained model"), (FROZEN_COLOR, "frozen model"), (TENSOR_FILL, "tensor"), (FUNCTION_FILL, "ppo_lab function")]
    x, y = 1.0, top - 2.6
    for fill, label in legend:
        ax.add_patch(FancyBboxPatch((x, y - 1.2), 3.0, 2.4, boxstyle="round,pad=0,rounding_size=0.4", fc=fill, ec=INK, lw=0.8))
        ax.text(x + 4.0, y, label, va="center", fontsize=FONT, color=INK, gid=f"legend:{label}")
        x += 4.0 + 0.75 * len(label) + 3.0
    return fig


# --- chapter 2: REINFORCE, where the gradient flows ------------------------------------------


def reinforce_flow() -> Figure:
    """Four sampled responses to one prompt, their sentiment scores (the task's reward function),
    the weights Psi = R - b with the batch-mean baseline, and the gradient that autograd sends to
    each sampled token's log-probability through `reinforce_loss`: Psi / B on every real token of a
    response, nothing on padding, and nothing through the reward or the sampling."""
    import torch

    ppo_lab = ppo_lab_package()
    require_arguments(ppo_lab.reinforce_loss, "logprobs", "weights", "mask")
    prompt = "the pizza was"
    responses = [["great", "."], ["so", "dull", "."], ["nice", "and", "hot", "."], ["terrible", "."]]
    B, T = len(responses), max(len(r) for r in responses)
    scores = torch.tensor(ppo_lab.get_task("sentiment").reward([prompt] * B, [" ".join(r) for r in responses]), dtype=torch.float64)
    baseline = scores.mean()
    psi = scores - baseline
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (T - len(r)) for r in responses], dtype=torch.float64)
    logprobs = torch.full((B, T), -1.0, dtype=torch.float64, requires_grad=True)  # any values: the gradient does not depend on them
    loss = ppo_lab.reinforce_loss(logprobs, psi[:, None].expand(B, T) * mask, mask)
    loss.backward()
    push = -logprobs.grad  # the direction a gradient step moves each log-probability
    require(torch.allclose(push, psi[:, None] / B * mask), "reinforce_loss's gradient is not Psi / B on the real tokens")

    fig, ax, top = canvas(10.0, 4.5)
    ax.text(1.0, top - 2.6, "$\\mathcal{L}(\\theta) = -\\frac{1}{B} \\sum_i \\sum_t \\log \\pi_\\theta(a_{i,t} \\mid s_{i,t})\\; \\mathrm{sg}[\\Psi_i]$"
            f"      $\\Psi_i = R(x, y_i) - b$, $b$ = the batch's mean score = {baseline.item():+.3f},  $B$ = {B}",
            ha="left", va="center", fontsize=FONT + 1, color=INK, gid="formula")
    cw, ch, y0 = 7.6, 5.2, top - 13.5  # token cells
    xt = 20.0
    rows = [y0 - i * (ch + 2.2) for i in range(B)]
    from ppo_lab.plotting import TRAINED_COLOR

    mid = (rows[0] + rows[-1] + ch) / 2
    box(ax, 1.0, mid - 5.0, 13.0, 10.0, "policy $\\pi_\\theta$\n\nprompt\n\"" + prompt + "\"", fill=TRAINED_COLOR, gid="policy")
    ax.text(xt, y0 + ch + 1.2, "sampled tokens $a_{i,t}$ (padding hatched)", ha="left", va="bottom", fontsize=FONT, color=GREY, gid="head:tokens")
    xr, wr = xt + T * cw + 3.5, 11.5  # the reward function
    xs, xp, xg, wc = xr + wr + 2.5, xr + wr + 12.5, xr + wr + 23.0, 9.0
    for x, label, gid in ((xs + wc / 2, "score $R$", "head:R"), (xp + wc / 2, "$\\Psi = R - b$", "head:psi"), (xg + wc / 2, "$-\\partial\\mathcal{L} / \\partial \\log\\pi$", "head:grad")):
        ax.text(x, y0 + ch + 1.2, label, ha="center", va="bottom", fontsize=FONT, color=INK, gid=gid)
    for i, (y, tokens) in enumerate(zip(rows, responses)):
        arrow(ax, (14.0, mid), (xt - 0.3, y + ch / 2), color=GREY, lw=1.0, ls="--")
        for t in range(T):
            real = t < len(tokens)
            g = push[i, t].item()
            fill = ("#d4e6f5" if g > 0 else "#f3d9e8") if real else PAD
            ax.add_patch(Rectangle((xt + t * cw, y), cw, ch, fc=fill, ec="0.6", lw=0.8, hatch=None if real else "///"))
            if real:
                ax.text(xt + (t + 0.5) * cw, y + ch / 2, tokens[t], ha="center", va="center", fontsize=FONT, family="monospace", color=INK, gid=f"tok:{i}:{t}")
        arrow(ax, (xt + T * cw, y + ch / 2), (xr, y + ch / 2), color=INK, lw=1.0)
        for x, value, gid in ((xs, scores[i], "R"), (xp, psi[i], "psi"), (xg, push[i, 0], "grad")):
            ax.add_patch(Rectangle((x, y), wc, ch, fc="white", ec="0.6", lw=0.8))
            ax.text(x + wc / 2, y + ch / 2, f"{value.item():+.3f}", ha="center", va="center", fontsize=FONT, family="monospace", color=INK, gid=f"{gid}:{i}")
        arrow(ax, (xr + wr, y + ch / 2), (xs, y + ch / 2), color=INK, lw=1.0)
    ax.add_patch(Rectangle((xr, rows[-1]), wr, rows[0] + ch - rows[-1], fc="white", ec=GREY, lw=1.0, hatch="..", zorder=1))
    ax.text(xr + wr / 2, mid, "$R(x, y)$\nsentiment\nlexicon:\nno gradient", ha="center", va="center", fontsize=FONT, color=INK,
            bbox=dict(fc="white", ec="none", pad=1.0), zorder=3, gid="reward")
    ax.text(13.8, rows[-1] - 1.2, "sampling: no gradient", ha="left", va="top", fontsize=FONT, color=GREY, style="italic", gid="note:sampling")
    # the backward pass: from the loss, through the log-probs of the sampled tokens, into the policy
    yb = rows[-1] - 5.8
    polyline(ax, [(xg + wc / 2, rows[-1]), (xg + wc / 2, yb), (7.25, yb), (7.25, mid - 5.0)], color=VERMILION, lw=1.6)
    ax.text(xr + 1.0, yb + 0.7, "backward: $-\\partial\\mathcal{L} / \\partial \\log\\pi_\\theta(a_{i,t})$ = $\\Psi_i / B$ on every real token of response $i$",
            ha="right", va="bottom", fontsize=FONT, color=VERMILION, gid="note:backward")
    ax.text(1.0, yb - 1.4, "blue: made more likely by the step; purple: less likely. The reward is only a number that weights the score function.",
            ha="left", va="top", fontsize=FONT, color=INK, gid="note:colours")
    return fig


# --- chapter 4: GAE's backward recursion ----------------------------------------------------


def gae_recursion() -> Figure:
    """One response of four real tokens and two of padding, its rewards from `shape_rewards`
    and its TD errors, advantages and returns from `compute_gae` (the TD errors are GAE at
    lambda = 0), at the config's default gamma and lambda."""
    import torch

    ppo_lab = ppo_lab_package()
    from ppo_lab.config_groups import Advantage, Kl

    gamma, lam = setting(Advantage, "gamma").default, setting(Advantage, "lam").default
    beta = setting(Kl, "coef").default
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 0.0]])
    logprobs = torch.tensor([[-0.9, -1.6, -0.4, -0.2, -5.0, -5.0]])
    ref_logprobs = torch.tensor([[-1.1, -1.9, -0.5, -0.2, -5.0, -5.0]])
    scores = torch.tensor([0.8])
    rewards = ppo_lab.shape_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=beta)
    values = torch.tensor([[0.45, 0.35, 0.60, 0.70, 3.00, 3.00]])  # the critic's guesses on padding: junk
    deltas, _ = ppo_lab.compute_gae(rewards, values, mask, gamma, 0.0)
    adv, ret = ppo_lab.compute_gae(rewards, values, mask, gamma, lam)
    n, T = int(mask.sum()), mask.shape[1]
    for t in range(n):  # the picture's two formulas, on the package's numbers
        nxt_v = values[0, t + 1] if t + 1 < n else 0.0
        nxt_a = adv[0, t + 1] if t + 1 < n else 0.0
        require(abs(deltas[0, t] - (rewards[0, t] + gamma * nxt_v - values[0, t])) < 1e-5, "compute_gae's TD error is not r + gamma V' - V")
        require(abs(adv[0, t] - (deltas[0, t] + gamma * lam * nxt_a)) < 1e-5, "compute_gae's advantage is not delta + gamma lam A'")
    require(bool((adv[0, n:] == 0).all() and (ret[0, n:] == 0).all()), "compute_gae leaves something on padding")

    fig, ax, top = canvas(10.0, 5.6)
    lx, x0, cw, ch, gap = 1.0, 23.0, 12.5, 5.0, 3.5  # label column, first cell, cell width and height
    names = [
        ("mask", "mask $m_t$", mask, "{:.0f}"),
        ("rewards", "rewards $r_t$", rewards, "{:+.2f}"),
        ("values", "values $V(s_t)$", values, "{:+.2f}"),
        ("delta", "TD error $\\delta_t$", deltas, "{:+.2f}"),
        ("advantages", "advantages $\\hat A_t$", adv, "{:+.2f}"),
        ("returns", "returns $\\hat G_t = \\hat A_t + V(s_t)$", ret, "{:+.2f}"),
    ]
    formulas = (f"$\\delta_t = r_t + \\gamma V(s_{{t+1}}) - V(s_t)$      $\\hat A_t = \\delta_t + \\gamma\\lambda\\,\\hat A_{{t+1}}$"
                f"      ($\\gamma$ = {gamma:g}, $\\lambda$ = {lam:g})")
    ax.text(lx, top - 2.5, formulas, ha="left", va="center", fontsize=FONT + 1, color=INK, gid="note:formulas")
    ax.text(lx, top - 6.0, f"rewards from shape_rewards (score {scores[0].item():g}, $\\beta$ = {beta:g}); $\\delta$, advantages and returns from compute_gae",
            ha="left", va="center", fontsize=FONT, color=GREY, gid="note:source")
    y_head = top - 14.0
    ax.text(x0 + n * cw - 0.8, y_head + 5.2, "backward pass, $t = n, \\dots, 1$", ha="right", va="center", fontsize=FONT, color=VERMILION, gid="note:backward")
    arrow(ax, (x0 + n * cw - 0.4, y_head + 2.8), (x0 + 0.4, y_head + 2.8), color=VERMILION, lw=1.4)
    for t in range(T):
        real = t < n
        ax.text(x0 + (t + 0.5) * cw, y_head, f"t = {t + 1}" if real else "padding", ha="center", va="center",
                fontsize=FONT, color=INK if real else GREY, gid=f"head:{t}")
    row_y = {}
    for i, (key, label, tensor, fmt) in enumerate(names):
        y = row_y[key] = y_head - 2.5 - (i + 1) * ch - (gap if i >= 4 else 0.0)
        ax.text(lx, y + ch / 2, label, ha="left", va="center", fontsize=FONT, color=INK, gid=f"label:{key}")
        for t in range(T):
            real = t < n
            fill = ("#fbe3cc" if key == "advantages" else "white") if real else PAD
            ax.add_patch(Rectangle((x0 + t * cw, y), cw, ch, fc=fill, ec="0.6", lw=0.8, hatch=None if real else "///"))
            ax.text(x0 + (t + 0.5) * cw, y + ch / 2, fmt.format(tensor[0, t].item() + 0.0), ha="center", va="center", fontsize=FONT,
                    family="monospace", color=INK if real else GREY, gid=f"{key}:{t}",
                    bbox=None if real else dict(fc=PAD, ec="none", pad=0.5))
    # the backward pass: each advantage from the next real token's, times gamma * lambda
    ya = row_y["advantages"] + ch
    for t in range(n - 1):
        arrow(ax, (x0 + (t + 1) * cw + 3.0, ya + 0.3), (x0 + t * cw + cw - 3.0, ya + 0.3), color=VERMILION, lw=1.4, rad=0.45)
        ax.text(x0 + (t + 1) * cw + 3.6, ya + 1.7, "$\\times\\gamma\\lambda$", ha="left", va="center", fontsize=FONT, color=VERMILION, gid=f"gl:{t}")
    # where the recursion starts: after the last real token the episode is over
    end_x = x0 + n * cw
    ax.plot([end_x, end_x], [row_y["returns"], y_head + 1.5], color=VERMILION, lw=2.0)
    ax.text(x0, row_y["returns"] - 1.2,
            "The vertical line: the episode ends after the last real token, so $V(s_{n+1}) = 0$ and $\\hat A_{n+1} = 0$. The pass skips\n"
            f"the padding, so the critic's {values[0, n].item():.2f} there never reaches an advantage; compute_gae writes 0 on padding.",
            ha="left", va="top", fontsize=FONT, color=INK, gid="note:end", linespacing=1.4)
    return fig


# --- chapter 5: where the KL term enters ----------------------------------------------------


def kl_placement() -> Figure:
    """The two values of `kl.placement`: the KL penalty in each token's reward (computed once per
    rollout) or beside the policy loss (recomputed with gradients). The per-token rewards are
    `shape_rewards`' with the weight the trainer gives it in each case (`Objective.shape`), the
    loss term `ppo_loss`'s "loss/kl"."""
    import functools

    import torch

    ppo_lab = ppo_lab_package()
    from ppo_lab.config_groups import Kl
    from ppo_lab.losses import get_policy_loss, ppo_loss

    placement, coef, estimator = (setting(Kl, name) for name in ("placement", "coef", "estimator"))
    require(tuple(placement.metadata.get("choices", ())) == ("reward", "loss"), "kl.placement's values are no longer 'reward' and 'loss'")
    beta, default_placement, default_estimator = coef.default, placement.default, estimator.default
    require("k3" in ppo_lab.KL_ESTIMATORS, "k3 is no longer a KL estimator")
    require_arguments(ppo_lab.kl_penalty, "logprobs", "ref_logprobs")
    require_arguments(ppo_lab.shape_rewards, "scores", "logprobs", "ref_logprobs", "kl_coef", "kl_estimator")
    require_arguments(ppo_loss, "logprobs", "kl_coef", "kl_estimator")
    key = Kl.key  # "kl"

    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    old_logprobs = torch.tensor([[-0.8, -0.6, -1.5, -0.3, 0.0]])
    ref_logprobs = torch.tensor([[-1.0, -0.9, -2.0, -0.4, 0.0]])
    scores = torch.tensor([1.0])
    in_reward = ppo_lab.shape_rewards(scores, old_logprobs, ref_logprobs, mask, kl_coef=beta, kl_estimator=default_estimator)
    score_only = ppo_lab.shape_rewards(scores, old_logprobs, ref_logprobs, mask, kl_coef=0.0)  # what Objective.shape passes
    logprobs = old_logprobs.clone().requires_grad_()  # the current policy, at the first step of the update
    batch = {"mask": mask, "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs, "advantages": torch.zeros_like(mask)}
    policy_loss = functools.partial(get_policy_loss("clip"), clip_eps=0.2)
    loss, metrics = ppo_loss(policy_loss, logprobs=logprobs, values=None, batch=batch, vf_coef=0.0, value_clip=None,
                             kl_coef=beta, kl_estimator="k3")
    loss.backward()
    require(bool(logprobs.grad[0, :4].abs().sum() > 0), "the KL term in the loss sends no gradient to the log-probs")
    kl_term = metrics["loss/kl"].item()

    fig, ax, top = canvas(10.0, 5.0)
    h = 6.4
    ya, yb, yk = top - 13.0, top - 32.0, top - 43.5  # lane A's row, lane B's reward row and its KL row
    xin, win = 1.0, 13.5  # inputs
    xfn, wfn = 17.5, 18.0  # shape_rewards / kl_penalty
    xst, wcell = 38.5, 5.9  # the rewards strip
    xgae, wgae = 71.0, 11.0
    xloss, wloss = 85.0, 14.0

    def lane_title(y, value, note):
        dflt = "  (the default)" if value == default_placement else ""
        ax.text(1.0, y, f'{key}.placement = "{value}"{dflt}', ha="left", va="bottom", fontsize=FONT + 1, weight="bold",
                family="monospace", color=INK, gid=f"title:{value}")
        ax.text(1.0, y - 0.7, note, ha="left", va="top", fontsize=FONT, color=GREY, gid=f"note:{value}")

    def strip(y, rewards, gid):
        for t in range(rewards.shape[1]):
            real = bool(mask[0, t])
            ax.add_patch(Rectangle((xst + t * wcell, y - h / 2), wcell, h, fc="white" if real else PAD, ec="0.6", lw=0.8,
                                   hatch=None if real else "///"))
            ax.text(xst + (t + 0.5) * wcell, y, f"{rewards[0, t].item() + 0.0:+.2f}" if real else "0", ha="center", va="center",
                    fontsize=FONT, family="monospace", color=INK if real else GREY, gid=f"{gid}:{t}",
                    bbox=None if real else dict(fc=PAD, ec="none", pad=0.5))
        ax.text(xst + rewards.shape[1] * wcell / 2, y + h / 2 + 0.5, "rewards of one response", ha="center", va="bottom",
                fontsize=FONT, color=GREY, gid=f"{gid}:label")
        return xst + rewards.shape[1] * wcell

    def to_loss(y, lane, text, edge=INK, lw=1.0):
        end = strip(y, in_reward if lane == "a" else score_only, f"{lane}:rewards")
        arrow(ax, (xfn + wfn, y), (xst, y))
        box(ax, xgae, y - h / 2, wgae, h, "GAE:\nadvantages", fill=FUNCTION_FILL, gid=f"{lane}:gae")
        arrow(ax, (end, y), (xgae, y))
        box(ax, xloss, y - h / 2, wloss, h, text, gid=f"{lane}:loss", edge=edge, lw=lw)
        arrow(ax, (xgae + wgae, y), (xloss, y))

    # lane A: the KL in the reward
    lane_title(top - 3.0, "reward", "computed once per rollout from the stored log-probs, without gradient; it reaches the policy through the advantages")
    box(ax, xin, ya - h / 2, win, h, "old_logprobs\nref_logprobs\nscores", mono=True, gid="a:inputs")
    box(ax, xfn, ya - h / 2, wfn, h, f"shape_rewards:\n$-${key}.coef $\\times$ $\\widehat{{\\mathrm{{KL}}}}_t$ + score\n($\\widehat{{\\mathrm{{KL}}}}_t$ by {key}.estimator)", fill=FUNCTION_FILL, gid="a:shape")
    arrow(ax, (xin + win, ya), (xfn, ya))
    to_loss(ya, "a", "policy loss\n(no KL term)")

    # lane B: the KL in the loss
    lane_title(top - 22.0, "loss", "GRPO style: recomputed at every step from the current policy, with gradient, beside the policy loss")
    box(ax, xin, yb - h / 2, win, h, "scores", mono=True, gid="b:inputs")
    box(ax, xfn, yb - h / 2, wfn, h, "shape_rewards:\nthe score alone\n(KL weight 0)", fill=FUNCTION_FILL, gid="b:shape")
    arrow(ax, (xin + win, yb), (xfn, yb))
    to_loss(yb, "b", f"policy loss\n+ {key}.coef $\\times$ KL", edge=VERMILION, lw=1.6)
    box(ax, xin, yk - h / 2, win, h, "logprobs\nref_logprobs", mono=True, gid="b:kl_inputs", edge=VERMILION, lw=1.6)
    box(ax, xfn, yk - h / 2, wfn, h, f"kl_penalty\n({key}.estimator,\n\"k3\" in GRPO)", fill=FUNCTION_FILL, gid="b:kl")
    arrow(ax, (xin + win, yk), (xfn, yk), color=VERMILION, lw=1.6)
    polyline(ax, [(xfn + wfn, yk), (xloss + wloss / 2, yk), (xloss + wloss / 2, yb - h / 2)], color=VERMILION, lw=1.6)
    ax.text(xfn + wfn + 2.0, yk - 0.8, f"here loss/kl = {kl_term:.3f} (ppo_loss: k3 averaged over\nthe real tokens), weighted by {key}.coef = {beta:g}",
            ha="left", va="top", fontsize=FONT, color=VERMILION, gid="b:term", linespacing=1.3)
    return fig


# --- chapter 6: the clip regions ------------------------------------------------------------


def clip_regions() -> Figure:
    """PPO-clip's objective for one token against its ratio, for A > 0 and A < 0, at the default
    `loss.clip_eps`; the shaded spans are where autograd through `clipped_policy_loss` gives
    exactly zero gradient, which are also where its `policy/clipfrac` counts the token."""
    import math

    import torch

    ppo_lab = ppo_lab_package()
    from ppo_lab.config_groups import Loss

    eps = setting(Loss, "clip_eps").default
    lo_r, hi_r = 0.35, 1.75
    ratios = torch.linspace(lo_r, hi_r, 561, dtype=torch.float64)

    def evaluate(adv: float):
        objective, grads, clipped = [], [], []
        for r in ratios.tolist():
            logprob = torch.tensor([[math.log(r)]], dtype=torch.float64, requires_grad=True)
            loss, metrics = ppo_lab.clipped_policy_loss(logprob, torch.zeros(1, 1, dtype=torch.float64),
                                                        torch.tensor([[adv]], dtype=torch.float64), torch.ones(1, 1), clip_eps=eps)
            loss.backward()
            objective.append(-loss.item())
            grads.append(logprob.grad.item())
            clipped.append(metrics["policy/clipfrac"].item())
        return objective, grads, clipped

    cases = {1.0: [(0.6, 1), (1.1, 2), (1.5, 3)], -1.0: [(0.6, 4), (0.9, 5), (1.5, 6)]}  # chapter 6's six cases
    fig = Figure(figsize=(10.0, 4.4), dpi=DPI)
    axes = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.075, right=0.985, top=0.87, bottom=0.14, wspace=0.2)
    for ax, adv in zip(axes, (1.0, -1.0)):
        objective, grads, clipped = evaluate(adv)
        cut = [g == 0.0 for g in grads]
        require(cut == [c == 1.0 for c in clipped], "policy/clipfrac does not count exactly the tokens with no gradient")
        spans, start = [], None
        for i, c in enumerate(cut + [False]):
            if c and start is None:
                start = i
            if not c and start is not None:
                spans.append((ratios[start].item(), ratios[i - 1].item()))
                start = None
        require(len(spans) == 1, f"A = {adv:+g}: the gradient is cut on {len(spans)} spans of the ratio, not one")
        (a, b), step = spans[0], (hi_r - lo_r) / (len(ratios) - 1)
        expect = (1 + eps, hi_r) if adv > 0 else (lo_r, 1 - eps)
        require(abs(a - expect[0]) <= step + 1e-9 and abs(b - expect[1]) <= step + 1e-9,
                 f"A = {adv:+g}: the gradient is cut on [{a:.3f}, {b:.3f}], not {expect}")
        up = adv > 0
        ymin, ymax = (-0.1, 2.2) if up else (-2.2, 0.1)
        ax.axvspan(a, b, fc=PAD, ec="0.72", hatch="//", lw=0.0, zorder=0)
        for x in (1 - eps, 1 + eps):
            ax.axvline(x, color=GREY, lw=0.9, ls="--", zorder=1)
        ax.plot(ratios, [adv * r for r in ratios.tolist()], ":", color=INK, lw=1.3, label="$\\rho \\hat A$, the unclipped surrogate")
        ax.plot(ratios, objective, color=BLUE, lw=2.4, label="$L^{\\mathrm{CLIP}}$, from clipped_policy_loss")
        flat = (1 + eps) * adv if up else (1 - eps) * adv
        ax.text((a + b) / 2, flat + (-0.5 if up else -0.55), "gradient cut:\nno pull further out\n(policy/clipfrac\ncounts these)",
                ha="center", va="center", fontsize=FONT, color=INK, bbox=dict(fc="white", ec="0.6", pad=2.5), gid=f"cut:{adv:+g}",
                linespacing=1.25)
        for r, k in cases[adv]:
            i = int(torch.argmin((ratios - r).abs()))
            ax.plot(ratios[i], objective[i], "o", color=VERMILION, ms=6, zorder=5)
            ax.annotate(str(k), (ratios[i].item(), objective[i]), xytext=(-8, 5) if up else (-8, -5), textcoords="offset points",
                        ha="right", va="bottom" if up else "top", fontsize=FONT + 1, weight="bold", color=VERMILION)
        # the direction a gradient step moves the ratio, where the gradient is not cut
        if up:
            tail, head, yarrow = lo_r + 0.04, 1 + eps - 0.03, ymax - 0.18
            ax.text(0.5 * (tail + head), yarrow - 0.12, "a gradient step raises $\\rho$", ha="center", va="top", fontsize=FONT, color=GREEN, gid="push:+")
        else:
            tail, head, yarrow = hi_r - 0.03, 1 - eps + 0.03, ymin + 0.18
            ax.text(1.12, yarrow + 0.12, "a gradient step lowers $\\rho$", ha="center", va="bottom", fontsize=FONT, color=GREEN, gid="push:-")
        arrow(ax, (tail, yarrow), (head, yarrow), color=GREEN, lw=1.8)
        ax.set_xlim(lo_r, hi_r)
        ax.set_ylim(ymin, ymax)
        ax.set_xticks([0.5, 1 - eps, 1.0, 1 + eps, 1.5])
        ax.set_xticklabels(["0.5", "1$-\\epsilon$", "1", "1$+\\epsilon$", "1.5"])
        ax.tick_params(labelsize=FONT)
        ax.set_xlabel("ratio $\\rho = \\pi_\\theta / \\pi_{\\mathrm{old}}$ of the token", fontsize=FONT)
        ax.set_title(f"advantage $\\hat A = {adv:+g}$", fontsize=FONT + 1)
    axes[0].set_ylabel("objective $L^{\\mathrm{CLIP}}$ of one token", fontsize=FONT)
    axes[1].legend(fontsize=FONT, loc="upper right", framealpha=1.0, edgecolor="0.8")
    fig.text(0.5, 0.965, f"PPO-clip with $\\epsilon$ = {eps:g} (loss.clip_eps); points 1 to 6: the chapter's six cases",
             ha="center", va="center", fontsize=FONT + 1, color=INK, gid="title")
    return fig


# --- chapter 7: one iteration of the trainer ------------------------------------------------


def trainer_iteration() -> Figure:
    """One call of `PPOTrainer.iterate` with the config's defaults: its phases, the grid of
    optimizer steps of the update (epochs x minibatches), and one optimizer step of
    `OptimizerStep.step`; what the trainer adds to `ppo_update` has a vermilion border. The
    counts and settings are the config's defaults, the method names the package's."""
    ppo_lab_package()
    from ppo_lab.config_groups import Batch, Kl, Optim, Run
    from ppo_lab.objective import Objective
    from ppo_lab.optimizer_step import OptimizerStep
    from ppo_lab.trainer import PPOTrainer

    for cls, names in ((PPOTrainer, ("iterate", "collect", "advantages", "update", "minibatch_loss")), (Objective, ("advantages",)),
                       (OptimizerStep, ("step", "backward", "clip_gradients"))):
        for name in names:
            require(hasattr(cls, name), f"{cls.__name__} has no method {name!r}, which trainer_iteration draws")
    rollout, minibatch, epochs, accumulation = (setting(Batch, n).default for n in ("rollout", "minibatch", "epochs", "accumulation_steps"))
    max_norm, early_kl, lr, schedule = (setting(Optim, n).default for n in ("max_grad_norm", "early_stop_kl", "lr", "schedule"))
    control, max_bad = setting(Kl, "control").default, setting(Run, "max_bad_updates").default
    per_epoch = rollout // minibatch
    require(rollout % minibatch == 0, "the default batch.minibatch does not divide batch.rollout")

    fig, ax, top = canvas(10.0, 6.0)
    added = dict(edge=VERMILION, lw=1.6)
    ax.text(1.0, top - 2.2, "One iteration of PPOTrainer.iterate, with the default settings", ha="left", va="center",
            fontsize=FONT + 1, weight="bold", color=INK)
    ax.text(99.0, top - 2.2, "vermilion border: what the trainer adds to ppo_update", ha="right", va="center", fontsize=FONT, color=VERMILION)
    # the phases of one iteration, steps 1 to 5 of the chapter's box
    h, y, w, gap = 11.0, top - 17.5, 23.0, 2.0
    phases = [
        ("1  roll out", "PPOTrainer.collect", f"sample {rollout} responses, score\nthem with every model"),
        ("2-3  advantages", "Objective.advantages", "shape_rewards, compute_gae,\nwhiten"),
        ("4  update", "PPOTrainer.update", f"{epochs} epochs x {per_epoch} minibatches\n= {epochs * per_epoch} optimizer steps"),
        ("5  KL controller", f'kl.control = "{control}"', "update $\\beta$ from the\nmeasured KL"),
    ]
    xs = [1.0 + i * (w + gap) for i in range(len(phases))]
    for x, (title, name, what) in zip(xs, phases):
        box(ax, x, y, w, h, "")
        ax.text(x + 1.0, y + h - 1.2, title, ha="left", va="top", fontsize=FONT, weight="bold", color=INK)
        ax.text(x + 1.0, y + h - 3.9, name, ha="left", va="top", fontsize=FONT, family="monospace", color=GREY)
        ax.text(x + 1.0, y + 0.9, what, ha="left", va="bottom", fontsize=FONT, color=INK, linespacing=1.2)
    for a, b in zip(xs, xs[1:]):
        arrow(ax, (a + w, y + h / 2), (b, y + h / 2))
    tag_h = 5.4
    box(ax, xs[0], y - tag_h - 1.2, w, tag_h, f"not finite? skip the update\n(stop the run after {max_bad})", **added)
    box(ax, xs[3], y - tag_h - 1.2, w, tag_h, "metrics: one read-back\nfrom the device", **added)
    # the update: a grid of optimizer steps
    gx, cw, ch = 1.0, 6.4, 4.3
    g0 = gx + 11.0
    head = 27.0
    gy = head - 0.8 - epochs * ch
    ax.text(gx, head + 2.9, f"{epochs} epochs (batch.epochs), each a fresh shuffle", ha="left", va="bottom", fontsize=FONT, color=INK)
    ax.text(gx, head + 0.4, f"into minibatches of {minibatch} (batch.minibatch)", ha="left", va="bottom", fontsize=FONT, color=INK)
    for e in range(epochs):
        yy = gy + (epochs - 1 - e) * ch
        ax.text(gx, yy + ch / 2, f"epoch {e + 1}", ha="left", va="center", fontsize=FONT, color=GREY)
        for m in range(per_epoch):
            ax.add_patch(Rectangle((g0 + m * cw, yy + 0.3), cw - 0.6, ch - 0.6, fc="#fbe3cc", ec="0.6", lw=0.8))
            ax.text(g0 + m * cw + (cw - 0.6) / 2, yy + ch / 2, str(e * per_epoch + m + 1), ha="center", va="center", fontsize=FONT, color=INK)
    grid_right = g0 + per_epoch * cw
    ux = xs[2] + w / 2
    polyline(ax, [(ux, y), (ux, y - 3.2), ((gx + grid_right) / 2 + 6.0, y - 3.2), ((gx + grid_right) / 2 + 6.0, head + 5.4)],
             color=GREY, lw=1.0, ls="--")
    box(ax, gx, gy - 6.0, grid_right - gx + 8.0, 4.4, f"early stop: policy/approx_kl > {early_kl:g} before a step\nends the update (optim.early_stop_kl)",
        **added)
    # one optimizer step, for each cell of the grid
    sx, sw = grid_right + 11.0, 99.0 - grid_right - 11.0
    steps = [
        (f"{accumulation} micro-batch{'es' if accumulation > 1 else ''} (batch.accumulation_steps):\nforward, minibatch_loss, backward", added),
        ("gradients averaged over the processes (DDP)", added),
        (f"not finite? skip this step (stop the run after {max_bad})", added),
        (f"clip the gradient norm to {max_norm:g} (optim.max_grad_norm)", added),
        (f"one AdamW step, lr = {lr:g} (optim.lr)", {}),
        (f'learning-rate schedule "{schedule}" (optim.schedule)', added),
    ]
    ax.text(sx, head + 0.4, "each optimizer step (OptimizerStep.step):", ha="left", va="bottom", fontsize=FONT, color=INK)
    sh, sgap, yy = 3.1, 0.7, head
    for i, (text, style) in enumerate(steps):
        hh = sh * (1.5 if "\n" in text else 1.0)
        yy -= hh + (sgap if i else 0.3)
        box(ax, sx, yy, sw, hh, text, fill="white" if style else FUNCTION_FILL, **style)
        if i:
            arrow(ax, (sx + 3.0, yy + hh + sgap), (sx + 3.0, yy + hh))
    arrow(ax, (grid_right + 0.3, gy + epochs * ch / 2), (sx - 0.3, gy + epochs * ch / 2), color=GREY, lw=1.0, ls="--")
    return fig


# --- appendix A: which token receives the score ----------------------------------------------


def score_placement() -> Figure:
    """One padded response and the token that receives the sequence score under each
    implementation's choice: the rewards are `shape_rewards`' (the KL left out), TRL's and
    DeepSpeed-Chat's move is `disagreements.score_past_last`, AlpacaFarm's mask is the one a
    `!= pad` test gives when the pad token is the EOS token; the first token's advantage is
    `compute_gae`'s, and that of a recursion over padding `disagreements.gae_over_padding`'s
    (gamma = lambda = 1, values 0)."""
    import torch

    ppo_lab = ppo_lab_package()
    from ppo_lab import disagreements

    require_arguments(disagreements.score_past_last, "rewards", "scores", "mask")
    require_arguments(disagreements.gae_over_padding, "rewards", "values", "mask")
    tokens = ["so", "good", ".", "<eos>", "<pad>", "<pad>"]
    eos, pad = 9, 0
    ids = torch.tensor([[3, 4, 5, eos, pad, pad]])
    T = ids.shape[1]
    score = torch.tensor([1.0])
    zeros = torch.zeros(1, T)
    mask = ppo_lab.response_mask(ids, eos)  # up to and including the first EOS
    ours = ppo_lab.shape_rewards(score, zeros, zeros, mask, kl_coef=0.0)
    past = disagreements.score_past_last(ours, score, mask)
    same = ids.masked_fill(mask == 0, eos)  # the same response when the pad token is the EOS token
    early_mask = (same != eos).float()  # "not padding" by a test against the pad token
    early = ppo_lab.shape_rewards(score, zeros, zeros, early_mask, kl_coef=0.0)

    def first_advantage(rewards, m, over_padding=False):
        gae = disagreements.gae_over_padding if over_padding else ppo_lab.compute_gae
        return gae(rewards, zeros, m, 1.0, 1.0)[0][0, 0].item()

    rows = [
        ("ppo_lab, verl, OpenRLHF", "the last real token, from the mask", ours, mask,
         f"{first_advantage(ours, mask):.2f}: the score reaches every token"),
        ("TRL, DeepSpeed-Chat", "one past the last non-pad token", past, mask,
         f"{first_advantage(past, mask):.2f} with compute_gae: the score is lost\n"
         f"{first_advantage(past, mask, True):.2f} with their GAE over padding"),
        ("AlpacaFarm, pad == eos", "the EOS counts as padding: one early", early, early_mask,
         f"{first_advantage(early, early_mask):.2f}, but the EOS token itself\nis outside the mask"),
    ]
    where = [int(torch.nonzero(r[2][0]).flatten()[0]) for r in rows]
    require(where == [3, 4, 2], f"the score lands on tokens {where}, not the last real one, one past it and one before it")

    fig, ax, top = canvas(10.0, 3.8)
    lx, x0, cw, ch = 1.0, 31.0, 5.6, 4.8
    ax.text(lx, top - 2.2, "Which token receives the sequence score $R$", ha="left", va="center", fontsize=FONT + 1, weight="bold", color=INK)
    y_head = top - 7.5
    for t, tok in enumerate(tokens):
        ax.text(x0 + (t + 0.5) * cw, y_head, tok, ha="center", va="center", fontsize=FONT, family="monospace", color=INK if mask[0, t] else GREY)
    xn = x0 + T * cw + 2.0
    ax.text(xn, y_head, "advantage of the first token", ha="left", va="center", fontsize=FONT, color=INK)
    for i, (who, rule, rewards, m, note) in enumerate(rows):
        y = y_head - 3.0 - ch - i * (ch + 2.6)
        ax.text(lx, y + ch / 2 + 1.2, who, ha="left", va="center", fontsize=FONT, weight="bold", color=INK)
        ax.text(lx, y + ch / 2 - 1.3, rule, ha="left", va="center", fontsize=FONT, color=GREY)
        for t in range(T):
            real = bool(m[0, t])
            hit = rewards[0, t].item() != 0.0
            fill = "#fbe3cc" if hit else ("white" if real else PAD)
            ax.add_patch(Rectangle((x0 + t * cw, y), cw, ch, fc=fill, ec=VERMILION if hit else "0.6", lw=1.6 if hit else 0.8,
                                   hatch=None if real else "///"))
            if hit:
                ax.text(x0 + (t + 0.5) * cw, y + ch / 2, "$R$", ha="center", va="center", fontsize=FONT, color=INK,
                        bbox=None if real else dict(fc="#fbe3cc", ec="none", pad=0.5))
        ax.text(xn, y + ch / 2, note, ha="left", va="center", fontsize=FONT, color=INK, linespacing=1.3)
    ax.text(lx, 0.8, "Hatched: outside the implementation's mask. compute_gae and the losses read only the positions inside it.",
            ha="left", va="bottom", fontsize=FONT, color=GREY)
    return fig


# --- the opening page: the map of the chapters ------------------------------------------------

# What each chapter builds on, beyond the one before it (chapters 1 to 7 are a chain). Appendix D
# (the course) draws on every chapter. Kept here, beside the picture, and checked against the
# pages' titles and _toc.yml.
MAP_CHAIN = ["ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07"]
MAP_BRANCHES = {"ch08": ["ch07", "ch05"], "ch09": ["ch07", "ch03"], "ch10": ["ch07", "ch02", "ch06"],
                "appendix_a": ["ch07"], "appendix_b": ["ch07"], "appendix_c": ["ch10"]}


def _page_text(stem: Path) -> str:
    """A page's markdown: its .md source, or the markdown cells of its .ipynb where the page is a
    notebook only (the student edition's scratch tree)."""
    if stem.with_suffix(".md").exists():
        return stem.with_suffix(".md").read_text()
    import json

    cells = json.loads(stem.with_suffix(".ipynb").read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _map_titles() -> dict[str, str]:
    """Page prefix ("ch05", "appendix_b") -> its short title, read from the page's first heading:
    the text before the first comma or colon ("5. Reward shaping and the KL penalty")."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [c["file"] for part in toc["parts"] for c in part["chapters"]]
    titles = {}
    for prefix in [*MAP_CHAIN, *MAP_BRANCHES, "appendix_d"]:
        (name,) = [f for f in files if Path(f).name.startswith(prefix + "_")]
        heading = next(line for line in _page_text(ROOT / name).splitlines() if line.startswith("# "))
        title = re.split(r"[,:] ", heading[2:].replace("Appendix D: ", "D. "), maxsplit=1)[0]
        titles[prefix] = title
    return titles


def chapter_map() -> Figure:
    """The chapters as a map: the chain from chapter 1 to chapter 7, the chapters and appendices
    that build on it, and what each of them returns to."""
    import textwrap

    titles = _map_titles()
    fig, ax, top = canvas(10.0, 5.8)
    w, h, step, y_chain = 10.0, 9.0, 11.3, 32.0
    boxes = {}
    for i, prefix in enumerate(MAP_CHAIN):
        fill = "#dbe9f6" if i < 3 else "#fbe3cf"
        boxes[prefix] = box(ax, 1.0 + i * step, y_chain, w, h, textwrap.fill(titles[prefix], 13), fill=fill)
    for a, b in zip(MAP_CHAIN, MAP_CHAIN[1:]):
        arrow(ax, (boxes[a][2], y_chain + h / 2), (boxes[b][0], y_chain + h / 2))
    later = ["ch08", "ch09", "ch10"]
    for j, prefix in enumerate(later):
        back = ", ".join(str(int(q[2:])) for q in MAP_BRANCHES[prefix] if q != "ch07")
        boxes[prefix] = box(ax, 85.0, 44.0 - j * 13.0, 14.0, 11.0, textwrap.fill(titles[prefix], 15) + f"\n(also {back})", fill="#d5efe6")
    appendices = {"appendix_d": 4.0, "appendix_a": 22.0, "appendix_b": 40.0, "appendix_c": 58.0}
    for prefix, x0 in appendices.items():
        note = "\n(every chapter)" if prefix == "appendix_d" else ""
        boxes[prefix] = box(ax, x0, 3.0, 14.0, 11.0, textwrap.fill(titles[prefix], 16) + note, fill=FUNCTION_FILL)
    c7 = boxes["ch07"]
    for prefix in later:
        b = boxes[prefix]
        arrow(ax, (c7[2], y_chain + h / 2), (b[0], (b[1] + b[3]) / 2))
    for prefix in ("appendix_a", "appendix_b"):
        b = boxes[prefix]
        arrow(ax, ((c7[0] + c7[2]) / 2, y_chain), ((b[0] + b[2]) / 2, b[3]))
    b, c = boxes["ch10"], boxes["appendix_c"]
    polyline(ax, [((b[0] + b[2]) / 2, b[1]), ((b[0] + b[2]) / 2, (c[1] + c[3]) / 2), (c[2], (c[1] + c[3]) / 2)])
    for label, x, color in (("Foundations", 1.0, "#0b4f8a"), ("From the policy gradient to PPO", 1.0 + 3 * step, "#8a4b0b")):
        ax.text(x, y_chain + h + 1.5, label, ha="left", va="bottom", fontsize=FONT, color=color, weight="bold")
    ax.text(4.0, 14.0 + 1.5, "Appendices", ha="left", va="bottom", fontsize=FONT, color=INK, weight="bold")
    return fig


DIAGRAMS = {"rlhf_loop": rlhf_loop, "reinforce_flow": reinforce_flow, "gae_recursion": gae_recursion, "kl_placement": kl_placement, "clip_regions": clip_regions,
            "trainer_iteration": trainer_iteration, "chapter_map": chapter_map,
            "score_placement": score_placement}
