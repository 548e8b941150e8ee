"""Importance sampling: reusing samples drawn from an older policy.

Chapter 3 (Importance sampling) measures these. PPO samples a batch once with pi_old and then
takes several gradient steps on it, so every step after the first is off-policy; the ratio
pi_theta / pi_old corrects the expectation:

    E_{x ~ pi_theta}[f(x)] = E_{x ~ pi_old}[ (pi_theta(x) / pi_old(x)) f(x) ].

For a sequence the exact weight is the product of its token ratios, whose variance grows
exponentially with length; PPO instead applies one ratio per token (a first-order
approximation that is good while the policies are close), and clipping keeps them close.
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_float, check_mask, check_same_shape, check_tensor


def importance_weights(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
) -> torch.Tensor:
    """Ratios pi_theta / pi_old of sampled tokens or whole sequences.

    Args:
        logprobs: (B, T) log-probabilities under the current policy pi_theta.
        old_logprobs: (B, T) log-probabilities under the sampling policy pi_old.
        mask: (B, T) 1 on real response tokens.
        level: "token" for one ratio per token, "prefix" for the product of the ratios up to
            each token (per-decision importance sampling, Precup et al. 2000), "sequence" for
            the product over each response.

    Returns:
        level="token": (B, T) exp(logprobs - old_logprobs) at real tokens, 0 at padding (zeros
        carry no weight, so `effective_sample_size` of the whole tensor counts real tokens only).
        level="prefix": (B, T) exp(sum_{k <= t} mask_k * (logprobs_k - old_logprobs_k)) at real
        tokens, 0 at padding: the weight of a reward paid at token t. The first real token's
        equals its token ratio, the last one's the sequence weight. Naive equivalent:
        `torch.cumprod(torch.where(mask.bool(), ratio, 1), -1) * mask`.
        level="sequence": (B,) exp(sum_t mask * (logprobs - old_logprobs)). This overflows for
        long, drifted sequences: pass the log-weights to `effective_sample_size(...,
        log_weights=True)` instead when that matters.

    Example: log-ratios [[log 2, log 3, pad]] with mask [[1, 1, 0]]: token [[2, 3, 0]],
    prefix [[2, 6, 0]], sequence [6].
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    check_tensor("logprobs", logprobs, ndim=2)
    check_float(logprobs=logprobs, old_logprobs=old_logprobs)
    m = check_mask(mask, logprobs, "logprobs")
    check_choice("importance level", level, ("token", "prefix", "sequence"))
    log_ratio = torch.where(m.bool(), logprobs - old_logprobs, torch.zeros_like(logprobs))
    if level == "token":
        return torch.exp(log_ratio) * m
    if level == "prefix":  # padding adds 0 to the running sum, so it is skipped, not cut off
        return torch.exp(torch.cumsum(log_ratio, dim=-1)) * m
    return torch.exp(log_ratio.sum(dim=-1))


def effective_sample_size(weights: torch.Tensor, log_weights: bool = False) -> torch.Tensor:
    """Kish's effective sample size (sum w)^2 / sum w^2 of importance weights.

    Args:
        weights: importance weights of any shape (flattened); non-negative. Zeros (padding)
            add nothing to either sum.
        log_weights: if True, `weights` holds log-weights and the ESS is computed stably in
            log space: exp(2 logsumexp(lw) - logsumexp(2 lw)); padding should then be -inf.

    Returns:
        0-dim tensor between 1 and the number of nonzero weights: N when all weights are equal,
        close to 1 when one sample carries all the weight.

    Example: weights [1, 1, 1, 1] -> 4.0; weights [1, 0, 0, 0] -> 1.0; [4, 1, 1, 1] -> 49/19.
    """
    check_float(weights=weights)
    w = weights.flatten()
    if w.numel() == 0:
        raise ValueError("`weights` is empty; the effective sample size needs at least one weight")
    if log_weights:
        return torch.exp(2 * torch.logsumexp(w, 0) - torch.logsumexp(2 * w, 0))
    if bool((w < 0).any()):
        raise ValueError("`weights` must be non-negative (importance weights are ratios of probabilities)")
    if not bool((w > 0).any()):
        raise ValueError("`weights` are all zero; the effective sample size is undefined")
    return w.sum() ** 2 / (w**2).sum()
