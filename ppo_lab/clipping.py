"""PPO's clipped surrogate objective.

Chapter 6 (Clipping) draws its six cases. With the ratio rho = pi_theta / pi_old per token and
the advantage A, PPO-clip (Schulman et al., 2017) maximises

    min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A),

so the per-token loss is max(-rho * A, -clip(rho) * A). Its gradient is zero exactly when the
clipped term is the active one, which happens when A > 0 and rho > 1 + eps_high, or A < 0 and
rho < 1 - eps_low: a step is not rewarded for pushing the ratio further out than the trust
region. In the other four cases (inside the range, or outside it on the side that makes things
worse) the gradient is that of rho * A.

Two policy losses of the same family, for chapter 10: GSPO (`gspo_policy_loss`) clips one ratio
per response, the geometric mean of its tokens' ratios; CISPO (`cispo_policy_loss`) clips the
importance weight and keeps every token's gradient.

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
    norm_length: float | None = None,
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
        norm_length: the constant L of "seq-mean-token-sum-norm" (`objective.Objective`
            passes max_new_tokens); None means T, the tensors' padded width.

    Returns:
        loss: 0-dim tensor.
        metrics: detached 0-dim tensors: "policy/clipfrac" (share of real tokens whose clipped
            term is active, i.e. whose gradient is cut), "policy/approx_kl" (mean of the k3
            estimate (rho - 1) - log rho of KL(pi_old || pi_theta)), "policy/ratio_mean",
            "policy/ratio_min", "policy/ratio_max", and "policy/dual_clipfrac" when dual_clip
            is set.
    """
    m = _check_inputs(logprobs, old_logprobs, advantages, mask)
    eps_low, eps_high = _clip_range(clip_eps, clip_eps_high)
    real = m.bool()
    advantages = advantages.detach()
    ### BEGIN SOLUTION clipping
    # Padding may hold anything; a zero log-ratio there keeps exp() finite.
    log_ratio = torch.where(real, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    ### END SOLUTION
    metrics = {}
    if dual_clip is not None:
        c = check_range("dual_clip", dual_clip, low=1.0, low_open=True)
        capped = torch.minimum(per_token, -c * advantages)
        dual_active = (advantages < 0) & (capped < per_token)
        per_token = torch.where(advantages < 0, capped, per_token)
        metrics["policy/dual_clipfrac"] = masked_mean(dual_active.to(m.dtype), m)
    loss = aggregate_loss(per_token, m, loss_agg, norm_length)
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
    norm_length: float | None = None,
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
    m = _check_inputs(logprobs, old_logprobs, advantages, mask)
    beta = check_range("penalty_beta", penalty_beta, low=0.0)
    real = m.bool()
    log_ratio = torch.where(real, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    k3 = torch.expm1(log_ratio) - log_ratio
    per_token = -advantages.detach() * ratio + beta * k3
    loss = aggregate_loss(per_token, m, loss_agg, norm_length)
    with torch.no_grad():
        metrics = {
            "policy/clipfrac": torch.zeros((), dtype=m.dtype, device=m.device),
            "policy/approx_kl": masked_mean(k3.detach(), m),
            **_ratio_stats(ratio.detach(), m),
        }
    return loss, metrics


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    loss_agg: str = "seq-mean-token-mean",
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization's loss (Zheng et al. 2025): PPO-clip on a sequence ratio.

    The ratio of response i is the geometric mean of its token ratios,

        s_i = exp(mean_t (log pi_theta(y_t) - log pi_old(y_t)))   over its real tokens,

    so one token far off the old policy moves s_i by 1/|y_i| of its log-ratio, and the clip range
    is a band on whole responses (the paper uses eps_low = 3e-4, eps_high = 4e-4; token ratios
    stray much further than their geometric mean). It is written in GSPO's token form, as verl's
    `compute_policy_loss_gspo` is: each token's ratio is s_i * pi_theta(y_t) / sg[pi_theta(y_t)],
    whose value is s_i and whose gradient is s_i * grad log pi_theta(y_t); with "seq-mean-token-mean"
    aggregation and one advantage per response that is exactly the gradient of the sequence
    objective mean_i max(-s_i A_i, -clip(s_i) A_i). (verl always aggregates GSPO that way;
    here `loss.aggregation` is honoured, and the `gspo` preset sets seq-mean-token-mean.)

    Args:
        logprobs: (B, T) log pi_theta of the sampled tokens, with gradient.
        old_logprobs: (B, T) log pi_old of the same tokens.
        advantages: (B, T) advantages (one value per response, for the sequence objective).
        mask: (B, T) 1 on real response tokens.
        clip_eps, clip_eps_high: the band [1 - eps_low, 1 + eps_high] around s_i.
        loss_agg: loss aggregation mode.

    Returns:
        loss: 0-dim tensor. metrics: as `clipped_policy_loss`'s; the ratios are the s_i,
        "policy/clipfrac" is the share of real tokens whose response's s_i is clipped, and
        "policy/approx_kl" is the tokens' k3, as for PPO-clip, so `optim.early_stop_kl` means the same.
    """
    m = _check_inputs(logprobs, old_logprobs, advantages, mask)
    eps_low, eps_high = _clip_range(clip_eps, clip_eps_high)
    real = m.bool()
    advantages = advantages.detach()
    log_ratio = torch.where(real, logprobs - old_logprobs, torch.zeros_like(logprobs))
    seq_log_ratio = log_ratio.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)  # (B,) log s_i
    # value s_i at every token, gradient that of log pi_theta(y_t); capped at e^10 as verl does,
    # so a response far off the old policy cannot overflow (its term is clipped anyway)
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().clamp(max=10.0)[:, None]
    ratio = torch.exp(torch.where(real, token_log_ratio, torch.zeros_like(token_log_ratio)))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = aggregate_loss(torch.maximum(unclipped, clipped), m, loss_agg, norm_length)
    with torch.no_grad():
        metrics = {
            "policy/clipfrac": masked_mean((clipped > unclipped).to(m.dtype), m),
            "policy/approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, m),
            **_ratio_stats(ratio.detach(), m),
        }
    return loss, metrics


def cispo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    loss_agg: str = "token-mean",
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped IS-weight Policy Optimization (CISPO, MiniMax-M1, 2025).

    PPO-clip zeroes the gradient of a token whose ratio has left the band on the side the
    advantage pushes it; a rare token that the update makes likely (a "fork" in reasoning) then
    stops learning after the first minibatch. CISPO keeps every token's gradient and clips the
    importance weight instead, treated as a constant:

        loss per token = -sg[clip(rho, 1 - eps_low, 1 + eps_high)] * A * log pi_theta(y_t),

    whose gradient is -clip(rho) * A * grad log pi_theta: REINFORCE with a truncated importance
    weight. At rho = 1 it equals PPO's gradient. MiniMax-M1 tunes only eps_high and sets eps_low
    large (no lower bound); verl's example sets clip_ratio_low = 10 and clip_ratio_high = 0.2,
    which the `cispo` preset copies. The loss's value is not an objective (it is linear in the
    log-probs); only its gradient means anything.

    Args:
        logprobs: (B, T) log pi_theta of the sampled tokens, with gradient.
        old_logprobs: (B, T) log pi_old of the same tokens.
        advantages: (B, T) advantages (treated as constants).
        mask: (B, T) 1 on real response tokens.
        clip_eps, clip_eps_high: the weight is clipped to [1 - eps_low, 1 + eps_high].
        loss_agg: loss aggregation mode.

    Returns:
        loss: 0-dim tensor. metrics: as `clipped_policy_loss`'s; "policy/clipfrac" is the share
        of real tokens whose weight was truncated (rho outside the band).
    """
    m = _check_inputs(logprobs, old_logprobs, advantages, mask)
    eps_low, eps_high = _clip_range(clip_eps, clip_eps_high)
    real = m.bool()
    log_ratio = torch.where(real, logprobs - old_logprobs, torch.zeros_like(logprobs)).detach()
    ratio = torch.exp(log_ratio.clamp(max=20.0))  # (as verl: a constant, so only overflow matters)
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -weight * advantages.detach() * torch.where(real, logprobs, torch.zeros_like(logprobs))
    loss = aggregate_loss(per_token, m, loss_agg, norm_length)
    with torch.no_grad():
        metrics = {
            "policy/clipfrac": masked_mean((weight != ratio).to(m.dtype), m),
            "policy/approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, m),
            **_ratio_stats(ratio, m),
        }
    return loss, metrics


def _check_inputs(logprobs, old_logprobs, advantages, mask) -> torch.Tensor:
    """Check the four (B, T) inputs of a policy loss; return the mask as 0/1 floats."""
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    check_tensor("logprobs", logprobs, ndim=2)
    check_float(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    return check_mask(mask, logprobs, "logprobs")


def _clip_range(clip_eps: float, clip_eps_high: float | None) -> tuple[float, float]:
    """(eps_low, eps_high), checked; eps_high defaults to eps_low."""
    eps_low = check_range("clip_eps", clip_eps, low=0.0, low_open=True)
    return eps_low, eps_low if clip_eps_high is None else check_range("clip_eps_high", clip_eps_high, low=0.0, low_open=True)


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
