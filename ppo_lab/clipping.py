"""PPO's clipped surrogate objective.

Chapter 6 (Clipping) draws its six cases. With the ratio rho = pi_theta / pi_old per token and
the advantage A, PPO-clip (Schulman et al., 2017) maximises

    min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A),

so the per-token loss is max(-rho * A, -clip(rho) * A). Its gradient is zero exactly when the
clipped term is the active one, which happens when A > 0 and rho > 1 + eps_high, or A < 0 and
rho < 1 - eps_low: a step is not rewarded for pushing the ratio further out than the trust
region. In the other four cases (inside the range, or outside it on the side that makes things
worse) the gradient is that of rho * A.

Two extensions, both off by default:
- asymmetric clipping, eps_high != eps_low ("clip-higher", DAPO, Yu et al. 2025), which lets
  low-probability tokens grow faster;
- dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"): for A < 0
  the loss is also capped at -dual_clip * A (dual_clip > 1), because an unbounded rho times a
  negative advantage can otherwise dominate a batch.
"""

from __future__ import annotations

import torch

from ._checks import check_float, check_mask, check_range, check_same_shape, check_tensor
from .aggregation import aggregate_loss
from .masked import masked_mean


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    loss_agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO-clip policy loss, to be minimised.

    Args:
        logprobs: (B, T) log pi_theta of the sampled tokens, with gradient.
        old_logprobs: (B, T) log pi_old of the same tokens, from the rollout.
        advantages: (B, T) advantage estimates (treated as constants).
        mask: (B, T) 1 on real response tokens.
        clip_eps: eps_low > 0, the lower clip range (and the upper one unless given).
        clip_eps_high: eps_high > 0, the upper clip range; None means clip_eps.
        dual_clip: c > 1 caps the loss of negative-advantage tokens at -c * A; None disables.
        loss_agg: loss aggregation mode (see `aggregate_loss`).

    Returns:
        loss: 0-dim tensor.
        metrics: detached 0-dim tensors: "policy/clipfrac" (share of real tokens whose clipped
            term is active, i.e. whose gradient is cut), "policy/approx_kl" (mean of the k3
            estimate (rho - 1) - log rho of KL(pi_old || pi_theta)), "policy/ratio_mean",
            "policy/ratio_min", "policy/ratio_max", and "policy/dual_clipfrac" when dual_clip
            is set.
    """
    check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask
    )
    check_tensor("logprobs", logprobs, ndim=2)
    check_float(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    m = check_mask(mask, logprobs, "logprobs")
    eps_low = check_range("clip_eps", clip_eps, low=0.0, low_open=True)
    eps_high = eps_low if clip_eps_high is None else check_range(
        "clip_eps_high", clip_eps_high, low=0.0, low_open=True
    )
    real = m.bool()
    advantages = advantages.detach()
    # Padding may hold anything; a zero log-ratio there keeps exp() finite.
    log_ratio = torch.where(real, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics = {}
    if dual_clip is not None:
        c = check_range("dual_clip", dual_clip, low=1.0, low_open=True)
        capped = torch.minimum(per_token, -c * advantages)
        dual_active = (advantages < 0) & (capped < per_token)
        per_token = torch.where(advantages < 0, capped, per_token)
        metrics["policy/dual_clipfrac"] = masked_mean(dual_active.to(m.dtype), m)
    loss = aggregate_loss(per_token, m, loss_agg)
    with torch.no_grad():
        clip_active = (clipped > unclipped).to(m.dtype)
        approx_kl = torch.expm1(log_ratio) - log_ratio  # k3 with r = rho
        metrics.update(
            {
                "policy/clipfrac": masked_mean(clip_active, m),
                "policy/approx_kl": masked_mean(approx_kl.detach(), m),
                **_ratio_stats(ratio.detach(), m),
            }
        )
    return loss, metrics


def kl_penalized_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    penalty_beta: float,
    loss_agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's other variant, the adaptive KL penalty (Schulman et al., 2017, section 4).

    Instead of clipping the ratio, penalise the distance from the policy that sampled the batch:

        loss per token = -rho * A + beta * k3(pi_old || pi_theta),   k3 = (rho - 1) - log rho,

    with beta adapted between iterations by `PPOPenaltyKLController` (double it when the KL
    exceeds 1.5 x target, halve it below target / 1.5). Every token keeps a gradient; the
    penalty, not a hard boundary, holds the update near the old policy.

    Args:
        logprobs: (B, T) log pi_theta of the sampled tokens, with gradient.
        old_logprobs: (B, T) log pi_old of the same tokens.
        advantages: (B, T) advantage estimates (treated as constants).
        mask: (B, T) 1 on real response tokens.
        penalty_beta: the penalty weight beta >= 0.
        loss_agg: loss aggregation mode (see `aggregate_loss`).

    Returns:
        loss: 0-dim tensor.
        metrics: detached "policy/approx_kl", "policy/ratio_mean", "policy/ratio_min",
            "policy/ratio_max", and "policy/clipfrac" = 0 (nothing is clipped), so the same
            dashboards read both variants.
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    check_tensor("logprobs", logprobs, ndim=2)
    check_float(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    m = check_mask(mask, logprobs, "logprobs")
    beta = check_range("penalty_beta", penalty_beta, low=0.0)
    real = m.bool()
    log_ratio = torch.where(real, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    k3 = torch.expm1(log_ratio) - log_ratio
    per_token = -advantages.detach() * ratio + beta * k3
    loss = aggregate_loss(per_token, m, loss_agg)
    with torch.no_grad():
        metrics = {
            "policy/clipfrac": torch.zeros((), dtype=m.dtype, device=m.device),
            "policy/approx_kl": masked_mean(k3.detach(), m),
            **_ratio_stats(ratio.detach(), m),
        }
    return loss, metrics


def _ratio_stats(ratio: torch.Tensor, m: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean, min and max of the ratio over the real tokens of (B, T) `ratio` and 0/1 mask `m`.

    With `torch.where` rather than `ratio[m.bool()]`: boolean indexing has a data-dependent
    shape, so on a GPU it waits for the device (see `ppo_lab.syncs`); this is called per micro-batch.
    """
    real = m.bool()
    return {
        "policy/ratio_mean": masked_mean(ratio, m),
        "policy/ratio_min": torch.where(real, ratio, torch.full_like(ratio, float("inf"))).min(),
        "policy/ratio_max": torch.where(real, ratio, torch.full_like(ratio, float("-inf"))).max(),
    }
