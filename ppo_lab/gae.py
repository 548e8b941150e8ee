"""Generalized Advantage Estimation (Schulman et al., 2016).

Chapter 4 (Value functions and GAE) derives it. With the TD error

    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t),

the GAE advantage is the exponentially weighted sum of future TD errors,

    A_t = sum_{l >= 0} (gamma * lam)^l * delta_{t+l},

computed backwards as A_t = delta_t + gamma * lam * A_{t+1}. lam = 0 gives the one-step TD
error (low variance, biased by V); lam = 1 gives the Monte Carlo return minus V (unbiased, high
variance). The returns that train the critic are A_t + V(s_t), the lambda-return.

Masking, decided on purpose. AlpacaFarm's `_estimate_advantage` and TRL's loop run the recursion
over every position, padding included. AlpacaFarm zeroes nothing on padding (its KL penalty
lands there too, and its whitening counts padding), so whatever V predicts on padding after the
last token leaks into delta at the last real token. TRL zeroes the KL penalty on padding and
the values from the second padding position on, but keeps the critic's value at the first
padding position and puts the score there, one step past the last real token. `ppo_lab` follows verl's `compute_gae_advantage_return` instead:
positions with mask 0 are skipped (the recursion carries A and V through them) and the value
after the last real token is 0, because the episode has ended there. So nothing stored at masked
positions can change the result.
"""

from __future__ import annotations

import torch

from ._checks import check_float, check_mask, check_range, check_same_shape, check_tensor


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and lambda-returns over the real tokens of each response.

    Args:
        rewards: (B, T) per-token rewards (for RLHF: the shaped rewards, score at the last
            real token, -beta * KL at every real token).
        values: (B, T) critic values V(s_t), where s_t is everything before token t.
        mask: (B, T) 1 on real response tokens.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        advantages: (B, T) A_t at real tokens, 0 at padding.
        returns: (B, T) A_t + V(s_t) at real tokens (before any whitening of A), 0 at padding.

    Naive equivalent, per sequence, on the real tokens only (r, v compacted, n of them)::

        A = 0
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            A = r[t] + gamma * next_v - v[t] + gamma * lam * A
            advantages[t] = A

    Example: a one-token response (the bandit case), r = [1.0], v = [0.3]: A = 0.7, return 1.0.
    """
    check_same_shape(rewards=rewards, values=values, mask=mask)
    check_tensor("rewards", rewards, ndim=2)
    check_float(rewards=rewards, values=values)
    m = check_mask(mask, rewards, "rewards")
    gamma = check_range("gamma", gamma, 0.0, 1.0)
    lam = check_range("lam", lam, 0.0, 1.0)
    ### BEGIN SOLUTION gae
    real = m.bool()
    r = torch.where(real, rewards, torch.zeros_like(rewards))
    v = torch.where(real, values, torch.zeros_like(values)).to(r.dtype)

    advantages = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])  # (B,) V of the next real token; 0 after the end
    next_adv = torch.zeros_like(r[:, 0])  # (B,) A of the next real token
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * lam * next_adv
        # A padded position leaves both carries untouched, as if it were not there.
        next_adv = torch.where(real[:, t], adv_t, next_adv)
        next_value = torch.where(real[:, t], v[:, t], next_value)
        advantages[:, t] = next_adv
    advantages = advantages * m
    returns = (advantages + v) * m
    return advantages, returns
    ### END SOLUTION
