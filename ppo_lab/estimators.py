"""Advantage estimators, by name: GAE, REINFORCE, RLOO and GRPO in one interface.

Chapter 4 (GAE) and chapter 10 (Beyond PPO) use them. The trainer looks an estimator up by the
name in its config, so comparing them is a one-word change, as in verl's
`AdvantageEstimator` registry. Every estimator has the same signature:

    estimator(rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0, **options)
        -> (advantages, returns), both (B, T), zero on padding

- rewards: (B, T) per-token rewards (from `shape_rewards`: the score at the last real token
  and any KL penalty spread over the tokens).
- mask: (B, T) 1 on real response tokens.
- values: (B, T) critic values (GAE only; REINFORCE uses them as its baseline if given).
- group_ids: (B,) integer id of each response's prompt, for the group estimators: responses
  with the same id were sampled from the same prompt.

The group estimators (RLOO, GRPO) need no critic: the other responses to the same prompt are
the baseline. They see each response through its total reward R_i = sum_t rewards[i, t], and
give every real token of response i the same advantage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._checks import check_float, check_mask, check_range, check_same_shape, check_tensor
from .gae import compute_gae
from .masked import masked_mean
from .policy_gradient import discounted_returns

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator adding an estimator to the registry under `name` (names must be new)."""

    def add(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"an advantage estimator named {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return add


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`; a ValueError lists the valid names otherwise."""
    if name not in ADVANTAGE_ESTIMATORS:
        valid = ", ".join(repr(n) for n in sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; valid values are: {valid}")
    return ADVANTAGE_ESTIMATORS[name]


def compute_advantages(name: str, rewards: torch.Tensor, mask: torch.Tensor, **kwargs):
    """Shorthand for `get_advantage_estimator(name)(rewards, mask, **kwargs)`."""
    return get_advantage_estimator(name)(rewards, mask, **kwargs)


@register_advantage_estimator("gae")
def gae_estimator(rewards, mask, *, values=None, gamma=1.0, lam=1.0, **_):
    """GAE with a learned critic (`compute_gae`); `values` is required."""
    if values is None:
        raise ValueError("the 'gae' advantage estimator needs `values` from a critic")
    return compute_gae(rewards, values, mask, gamma, lam)


@register_advantage_estimator("reinforce")
def reinforce_estimator(rewards, mask, *, values=None, gamma=1.0, **_):
    """Reward-to-go minus a baseline: A_t = G_t - b_t, returns G_t.

    The baseline b_t is the critic's V(s_t) when `values` is given, otherwise the mean of G
    over all real tokens of the batch. The batch mean removes the largest source of variance,
    the common offset of the returns, but it is not quite a constant: it contains each sample's
    own return, which biases the expected gradient towards zero by a term of order 1/n (n real tokens
    in the batch; chapter 2 measures it). Use a critic, or the leave-one-out "rloo", when that
    bias matters.
    """
    returns = discounted_returns(rewards, mask, gamma)
    m = check_mask(mask, rewards, "rewards")
    if values is not None:
        check_same_shape(values=values, rewards=rewards)
        check_float(values=values)
        baseline = values
    else:
        baseline = masked_mean(returns, m)
    return (returns - baseline) * m, returns


def _group_totals(rewards, mask, group_ids):
    """(R, index, counts): per-response total reward (B,), group index (B,), group sizes (G,)."""
    check_tensor("rewards", rewards, ndim=2)
    check_float(rewards=rewards)
    m = check_mask(mask, rewards, "rewards")
    if group_ids is None:
        raise ValueError("group estimators need `group_ids`: a (B,) id of each response's prompt")
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    if group_ids.shape != rewards.shape[:1]:
        raise ValueError(
            f"`group_ids` has shape {tuple(group_ids.shape)}; expected ({rewards.shape[0]},), "
            "one id per response"
        )
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        raise ValueError(
            "every group in `group_ids` needs at least 2 responses (the others are the "
            f"baseline); group sizes found: {sorted(set(counts.tolist()))}"
        )
    totals = torch.where(m.bool(), rewards, torch.zeros_like(rewards)).sum(dim=-1)
    return totals, index, counts, m


@register_advantage_estimator("rloo")
def rloo_estimator(rewards, mask, *, group_ids=None, **_):
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024).

    A_i = R_i - mean_{j in group(i), j != i} R_j, broadcast over the tokens of response i;
    returns are R_i. Leaving i out keeps the baseline independent of response i's own sample,
    so the estimate stays unbiased.
    """
    totals, index, counts, m = _group_totals(rewards, mask, group_ids)
    group_sum = torch.zeros(counts.shape, dtype=totals.dtype, device=totals.device)
    group_sum.index_add_(0, index, totals)
    n = counts[index].to(totals.dtype)
    baseline = (group_sum[index] - totals) / (n - 1)
    advantages = (totals - baseline)[:, None] * m
    return advantages, totals[:, None] * m


@register_advantage_estimator("grpo")
def grpo_estimator(rewards, mask, *, group_ids=None, norm_by_std=True, eps=1e-6, **_):
    """Group Relative Policy Optimization's outcome advantage (Shao et al. 2024).

    A_i = (R_i - mean_group R) / (std_group R + eps), with the unbiased std, broadcast over
    the tokens of response i; returns are R_i. `norm_by_std=False` drops the division, as
    Dr. GRPO (Liu et al. 2025) recommends: dividing by a small std makes prompts the model
    nearly always solves (or always fails) weigh the most.
    """
    totals, index, counts, m = _group_totals(rewards, mask, group_ids)
    g = counts.shape[0]
    zeros = torch.zeros(g, dtype=totals.dtype, device=totals.device)
    n = counts.to(totals.dtype)
    mean = zeros.clone().index_add_(0, index, totals) / n
    sq = zeros.clone().index_add_(0, index, (totals - mean[index]) ** 2)
    std = torch.sqrt(sq / (n - 1))
    advantages = totals - mean[index]
    if norm_by_std:
        eps = check_range("eps", eps, low=0.0)
        advantages = advantages / (std[index] + eps)
    return advantages[:, None] * m, totals[:, None] * m
