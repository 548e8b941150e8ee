"""A Bernoulli bandit whose policy gradient is known: the yardstick for chapter 10's estimators.

Each of K prompts has one logit theta_k; a response is right with probability p_k = sigmoid(theta_k)
and earns reward 1, else 0. The objective J = mean_k p_k has the gradient

    dJ / d theta_k = p_k (1 - p_k) / K,

and one response y to prompt k has the score function d log pi(y) / d theta_k = 1 - p_k if it is
right, -p_k if not. A batch of n responses to each prompt gives an estimate

    g_k = 1 / (K n) * sum_i A_i * d log pi(y_i) / d theta_k,

with the advantages A_i from any estimator of the registry (`ppo_lab.estimators`); comparing the
expected estimate with dJ/dtheta says what the estimator's baseline and normaliser do to the
gradient. For estimators that see one group at a time (rloo, grpo, dr_grpo), the expectation is
exact: a group's advantages depend only on how many of its n responses were right, a binomial
count, so the expectation is a sum over n + 1 cases. Estimators with batch statistics
(reinforce, reinforce_pp, reinforce_pp_baseline) are sampled.
"""

from __future__ import annotations

import math

import torch

from .estimators import compute_advantages

GROUP_LOCAL = ("rloo", "grpo", "dr_grpo")


def true_gradient(p: torch.Tensor) -> torch.Tensor:
    """(K,) dJ/dtheta for J = mean_k p_k, p = sigmoid(theta): p_k (1 - p_k) / K."""
    p = p.double()
    return p * (1 - p) / len(p)


def expected_gradient(name: str, p: torch.Tensor, n: int, **options) -> torch.Tensor:
    """(K,) the exact expected estimate E[g] of a group-local estimator, n responses per prompt.

    Args:
        name: "rloo", "grpo" or "dr_grpo".
        p: (K,) each prompt's probability of a right response.
        n: responses per prompt, >= 2.
        options: passed to the estimator (e.g. eps for grpo).
    """
    if name not in GROUP_LOCAL:
        raise ValueError(f"expected_gradient is exact for the group-local estimators {GROUP_LOCAL}; sample {name!r} with sampled_gradients")
    if n < 2:
        raise ValueError(f"n = {n}: a group needs at least 2 responses")
    p = p.double()
    out = torch.zeros_like(p)
    for c in range(n + 1):  # c right answers in the group
        rewards = torch.tensor([1.0] * c + [0.0] * (n - c), dtype=torch.float64)[:, None]
        adv, _ = compute_advantages(name, rewards, torch.ones(n, 1), group_ids=[0] * n, **options)
        a_right = adv[0, 0] if c > 0 else 0.0
        a_wrong = adv[-1, 0] if c < n else 0.0
        weight = torch.tensor([math.comb(n, c)], dtype=torch.float64) * p**c * (1 - p) ** (n - c)
        out += weight * (c * a_right * (1 - p) - (n - c) * a_wrong * p) / n
    return out / len(p)


def sampled_gradients(name: str, p: torch.Tensor, n: int, batches: int, generator: torch.Generator, **options) -> torch.Tensor:
    """(batches, K) independent estimates g, each from one batch of n responses to every prompt
    (the estimator sees the whole batch of K n responses, as the trainer's rollout)."""
    p = p.double()
    K = len(p)
    right = (torch.rand(batches, K, n, generator=generator, dtype=torch.float64) < p[None, :, None]).double()
    group_ids = torch.arange(K).repeat_interleave(n)
    score = torch.where(right.bool(), 1 - p[None, :, None], -p[None, :, None])  # d log pi / d theta_k
    out = torch.empty(batches, K, dtype=torch.float64)
    for b in range(batches):
        rewards = right[b].reshape(K * n, 1)
        adv, _ = compute_advantages(name, rewards, torch.ones(K * n, 1), group_ids=group_ids, scores=rewards[:, 0], **options)
        out[b] = (adv[:, 0].view(K, n) * score[b]).sum(-1) / (K * n)
    return out
