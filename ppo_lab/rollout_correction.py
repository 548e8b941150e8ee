"""When the sampler is not the trainer: importance weights for the gap between their log-probs.

Chapter 9 (Scaling up) derives these. The large frameworks sample with an inference engine
(vLLM, SGLang) and train with another (FSDP, Megatron); with the same weights, their kernels,
precisions and batch shapes give log-probs that differ, so the responses come from a policy
pi_s (the sampler's) that is not the trainer's pi_old. Three policies are then in play
(decoupled PPO, Hilton et al. 2021): the behaviour policy pi_s that drew the tokens, the
proximal policy pi_old that the PPO ratio and its clip are taken against (recomputed by the
trainer's forward), and the current pi_theta. The policy gradient needs samples of pi_old, so
each token's loss is weighted by rho_t = pi_old / pi_s, fixed (no gradient):

    tis   (truncated IS; Yao et al. 2025):  w = min(rho, high)
    mis   (masked IS; IcePop):              w = rho if low <= rho <= high, else 0

at the token level (rho_t), or at the sequence level (rho = prod_t rho_t, the same weight for
every token of a response). Truncation keeps every token and bounds the variance at the price
of a small bias; masking drops the tokens (sequences) that are too far off and keeps the rest
unbiased. With no gap, rho = 1 and every correction is the identity.

The bypass form (verl's `bypass_mode`; `old_logprobs: sampling` in ppo_lab) skips the
trainer's forward and takes pi_s as pi_old: the PPO ratio pi_theta / pi_s is then the
importance weight, and its clip the truncation, so no weight is added (it would count the
ratio twice). It saves one forward and gives up the first step's ratio of exactly 1.
"""

from __future__ import annotations

import torch

from ._checks import check_same_shape, check_tensor
from .masked import masked_mean

CORRECTIONS = ("none", "tis", "mis")
LEVELS = ("token", "sequence")
_LOG_BOUND = 20.0  # log-ratios are clamped to +-20 before exp (verl's SAFETY_BOUND): exp(20) ~ 5e8


def log_ratios(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """log rho: (B, T) per token (level "token"), or each response's sum broadcast over its
    tokens (level "sequence"); 0 at padded positions.

    Args:
        old_logprobs: (B, T) log pi_old, the trainer's log-probs of the sampled tokens.
        sampler_logprobs: (B, T) log pi_s, the sampler's log-probs of the same tokens.
        mask: (B, T) 1 on real response tokens.
    """
    check_tensor("old_logprobs", old_logprobs, ndim=2)
    check_same_shape(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    if level not in LEVELS:
        raise ValueError(f"level = {level!r} is not one of {', '.join(map(repr, LEVELS))}")
    m = mask.to(old_logprobs.dtype)
    token = (old_logprobs - sampler_logprobs) * m
    if level == "token":
        return token
    return token.sum(dim=1, keepdim=True).expand_as(token) * m


def correction_weights(
    old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, *, kind: str = "tis", level: str = "token", low: float = 0.0, high: float = 2.0
) -> torch.Tensor:
    """(B, T) importance weights that correct a rollout drawn from pi_s for training as if from pi_old.

    Args:
        old_logprobs, sampler_logprobs, mask: as in `log_ratios`.
        kind: "tis" (w = min(rho, high)), "mis" (w = rho inside [low, high], 0 outside) or
            "none" (w = 1).
        level: "token" (rho_t) or "sequence" (rho = prod_t rho_t for all of a response's tokens).
        low, high: the bounds, 0 <= low < high (tis uses `high` only).

    Returns:
        (B, T) weights >= 0, detached, 0 at padded positions; all 1 on real tokens when the
        two log-probs are equal.
    """
    if kind not in CORRECTIONS:
        raise ValueError(f"kind = {kind!r} is not one of {', '.join(map(repr, CORRECTIONS))}")
    if not 0 <= low < high:
        raise ValueError(f"the bounds must satisfy 0 <= low < high, got low = {low!r}, high = {high!r}")
    m = mask.to(old_logprobs.dtype)
    if kind == "none":
        return m.clone()
    rho = torch.exp(log_ratios(old_logprobs.detach(), sampler_logprobs.detach(), mask, level).clamp(-_LOG_BOUND, _LOG_BOUND))
    if kind == "tis":
        return rho.clamp(max=high) * m
    inside = (rho >= low) & (rho <= high)
    return torch.where(inside, rho, torch.zeros_like(rho)) * m


def gap_metrics(
    old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor, *, kind: str = "none", level: str = "token"
) -> dict[str, torch.Tensor]:
    """How far the sampler is from the trainer, and what the correction did (0-dim tensors).

    Takes `old_logprobs`, `sampler_logprobs`, `mask` and `weights`, each (B, T), as in
    `correction_weights`.

    "sampler/kl": KL(pi_s || pi_old) per token, estimated with k3 = rho - 1 - log rho on the
    sampled tokens (unbiased, never negative); "sampler/ess": the effective sample size of the
    token ratios as a fraction, (mean rho)^2 / mean(rho^2), 1 with no gap (verl's
    `rollout_is_eff_sample_size`, without its clamp); "sampler/corrected_frac": the share of real
    tokens whose weight (from `correction_weights` with this `kind` and `level`) is not their
    rho, i.e. that the correction truncated or masked (0 for kind "none").
    """
    log_rho = log_ratios(old_logprobs, sampler_logprobs, mask, "token").clamp(-_LOG_BOUND, _LOG_BOUND)
    rho = torch.exp(log_rho)
    m = mask.to(rho.dtype)
    ess = masked_mean(rho, m) ** 2 / masked_mean(rho * rho, m)
    metrics = {"sampler/kl": masked_mean(torch.expm1(log_rho) - log_rho, m), "sampler/ess": ess}
    if kind == "none":
        metrics["sampler/corrected_frac"] = torch.zeros_like(ess)
    else:
        level_rho = torch.exp(log_ratios(old_logprobs, sampler_logprobs, mask, level).clamp(-_LOG_BOUND, _LOG_BOUND))
        changed = ~torch.isclose(weights, level_rho, rtol=1e-6, atol=0.0)
        metrics["sampler/corrected_frac"] = masked_mean(changed.to(rho.dtype), m)
    return metrics


def expected_logit_gradient(
    old_probs: torch.Tensor, sampler_probs: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The expectation and the second moment of a one-token policy-gradient estimate, exactly.

    For each of N states, a token y is drawn from the sampler, and the estimate of the gradient
    of E_old[A] with respect to the logits z of pi_old is w(y) A(y) (e_y - pi_old) (the gradient
    of log softmax(z)_y). Enumerating the vocabulary gives its expectation and second moment:

        g = sum_y pi_s(y) w(y) A(y) (e_y - pi_old)        (on-policy: pi_old * A, when A has mean 0 under pi_old)
        m = sum_y pi_s(y) w(y)^2 A(y)^2 ||e_y - pi_old||^2

    With w = pi_old / pi_s the expectation is the on-policy gradient exactly (chapter 9).

    Args:
        old_probs, sampler_probs: (N, V) the two distributions over the vocabulary.
        advantages: (N, V) A(y) of each token in each state.
        weights: (N, V) the correction weight of each token (ones: no correction).

    Returns:
        ((N, V) expected gradients, (N,) second moments).
    """
    check_same_shape(old_probs=old_probs, sampler_probs=sampler_probs, advantages=advantages, weights=weights)
    check_tensor("old_probs", old_probs, ndim=2)
    drawn = sampler_probs * weights * advantages  # (N, V)
    gradient = drawn - drawn.sum(-1, keepdim=True) * old_probs
    # ||e_y - p||^2 = 1 - 2 p_y + ||p||^2
    distance = 1 - 2 * old_probs + (old_probs * old_probs).sum(-1, keepdim=True)
    return gradient, (sampler_probs * weights**2 * advantages**2 * distance).sum(-1)
