"""The policy gradient: reward-to-go and the REINFORCE surrogate.

Chapter 2 (Policy gradients) derives these. The policy-gradient theorem says

    grad J(theta) = E[ sum_t grad log pi(a_t | s_t) * Psi_t ],

where Psi_t may be the whole return, the reward-to-go G_t, or G_t minus a baseline; all give the
same expectation, with different variance. `reinforce_loss` is a surrogate whose gradient is the
Monte Carlo estimate of -grad J, so that minimising it with any optimiser ascends J.
"""

from __future__ import annotations

import torch

from ._checks import check_float, check_mask, check_range, check_response_dim, check_same_shape
from .aggregation import aggregate_loss


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go G_t = sum_{k >= t} gamma^(k - t) r_k over the real tokens of each sequence.

    Args:
        rewards: (B, T) per-token rewards.
        mask: (B, T) 1 on real response tokens; the return is 0 after the last real token.
        gamma: discount in [0, 1].

    Returns:
        (B, T) reward-to-go at real positions, 0 at padding.

    Padding is skipped, not counted as a step: the sum runs over the real tokens after t, in
    order, and values at masked positions cannot change the result. (With the usual
    right-padded responses, this is the textbook G_t = r_t + gamma * G_{t+1}, G_T = 0.)

    Example: rewards [[0, 0, 1]], mask [[1, 1, 1]], gamma 0.5 -> [[0.25, 0.5, 1.0]].
    """
    check_same_shape(rewards=rewards, mask=mask)
    check_float(rewards=rewards)
    m = check_mask(mask, rewards, "rewards")
    gamma = check_range("gamma", gamma, 0.0, 1.0)
    r = torch.where(m.bool(), rewards, torch.zeros_like(rewards))
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])  # (B,) return from the next real token on
    for t in reversed(range(r.shape[1])):
        # At a padded position the running return passes through unchanged.
        running = torch.where(m[:, t].bool(), r[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * m


def reinforce_loss(
    logprobs: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str = "seq-mean-token-sum",
) -> torch.Tensor:
    """REINFORCE surrogate: a scalar whose gradient is the policy-gradient estimate, negated.

    Args:
        logprobs: (B, T) log pi(a_t | s_t) of the sampled tokens, with gradient.
        weights: (B, T) the Psi_t multiplying each score function (return, reward-to-go, or
            advantage); treated as a constant (detached).
        mask: (B, T) 1 on real response tokens.
        loss_agg: loss aggregation mode. The default "seq-mean-token-sum" averages over sequences
            and sums over tokens, which makes the gradient exactly the Monte Carlo estimate
            -(1/B) sum_b sum_t grad log pi(a_t | s_t) * Psi_t of -grad J.

    Returns:
        0-dim loss tensor, aggregate(-logprobs * weights).
    """
    check_same_shape(logprobs=logprobs, weights=weights, mask=mask)
    check_float(logprobs=logprobs, weights=weights)
    check_response_dim("logprobs", logprobs)
    return aggregate_loss(-logprobs * weights.detach(), mask, loss_agg)
