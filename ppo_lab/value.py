"""The critic's loss, with value clipping, and how much of the return it explains.

Chapter 4 (Value functions and GAE) introduces the loss; chapter 6 (Clipping) the clipping. The
critic regresses V(s_t) onto the returns from `compute_gae`. PPO implementations clip the new
value to stay within `critic.clip` of the value predicted at rollout time, and take the larger
of the clipped and unclipped squared errors (a pessimistic bound, like the policy's), as in
OpenAI baselines, TRL, DeepSpeed-Chat and verl.
"""

from __future__ import annotations

import torch

from ._checks import check_float, check_mask, check_range, check_same_shape
from .aggregation import aggregate_loss
from .masked import masked_mean, masked_var


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns] over the real tokens.

    Args:
        values: (B, T) critic predictions.
        returns: (B, T) regression targets.
        mask: (B, T) 1 on real response tokens.

    Returns:
        0-dim tensor: 1 for a perfect critic, 0 for one no better than a constant, negative for
        a worse one; nan when the returns have zero variance (nothing to explain).
    """
    check_same_shape(values=values, returns=returns, mask=mask)
    check_float(values=values, returns=returns)
    m = check_mask(mask, returns, "returns")
    out_dtype = torch.promote_types(values.dtype, returns.dtype)
    if out_dtype in (torch.float16, torch.bfloat16):
        # Both variances in float32 (a float16 one overflows to inf beyond 65504); the ratio,
        # a number near [0, 1], is cast back. float32 and float64 are computed as they are.
        values, returns, m = values.float(), returns.float(), m.float()
    # Biased variances: the n/(n-1) factors cancel in the ratio, and one real token is allowed.
    var_returns = masked_var(returns, m, unbiased=False)
    var_error = masked_var(returns - values, m, unbiased=False)
    # torch.where rather than an `if`: no read-back to the host (see `ppo_lab.syncs`)
    explained = torch.where(var_returns == 0, torch.full_like(var_returns, float("nan")), 1.0 - var_error / var_returns)
    return explained.to(out_dtype)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None,
    loss_agg: str = "token-mean",
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Squared-error critic loss with PPO's value clipping.

    Args:
        values: (B, T) current predictions V_theta(s_t), with gradient.
        old_values: (B, T) predictions at rollout time.
        returns: (B, T) targets (lambda-returns from `compute_gae`).
        mask: (B, T) 1 on real response tokens.
        value_clip: c >= 0; None disables clipping.
        loss_agg: loss aggregation mode (see `aggregate_loss`).
        norm_length: the constant L of "seq-mean-token-sum-norm" (None: T).

    Returns:
        loss: 0-dim, aggregate of 0.5 * max((V - R)^2, (V_clip - R)^2) with
            V_clip = V_old + clamp(V - V_old, -c, c).
        metrics: detached 0-dim tensors "value/clipfrac" (share of real tokens where the clipped
            error is the larger, so its gradient is cut), "value/explained_variance" (of the
            current predictions), "value/mean" and "value/error" (mean squared error).
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    check_float(values=values, old_values=old_values, returns=returns)
    m = check_mask(mask, values, "values")
    returns = returns.detach()
    ### BEGIN SOLUTION clipping
    unclipped = (values - returns) ** 2
    if value_clip is None:
        per_token = unclipped
        clipped_more = torch.zeros_like(unclipped)
    else:
        c = check_range("value_clip", value_clip, low=0.0)
        values_clipped = old_values + torch.clamp(values - old_values, -c, c)
        clipped = (values_clipped - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_more = (clipped > unclipped).to(values.dtype)
    ### END SOLUTION
    loss = 0.5 * aggregate_loss(per_token, m, loss_agg, norm_length)
    with torch.no_grad():
        metrics = {
            "value/clipfrac": masked_mean(clipped_more, m),
            "value/explained_variance": explained_variance(values.detach(), returns, m),
            "value/mean": masked_mean(values.detach(), m),
            "value/error": masked_mean(unclipped.detach(), m),
        }
    return loss, metrics
