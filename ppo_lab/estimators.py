"""Advantage estimators, by name: GAE, REINFORCE, RLOO, GRPO, Dr. GRPO and REINFORCE++ in one interface.

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
- scores: (B,) the responses' scalar scores before any KL shaping (REINFORCE++-baseline only).

The group estimators (RLOO, GRPO, Dr. GRPO) need no critic: the other responses to the same
prompt are the baseline. They see each response through its total reward R_i = sum_t
rewards[i, t], and give every real token of response i the same advantage. REINFORCE++ and its
baseline variant keep per-token returns-to-go (the KL penalty of later tokens included) and
normalise them over the whole batch instead of per group (Hu et al. 2025, as in OpenRLHF's
`compute_advantages_and_returns`).

What each subtracts and divides by (chapter 10 measures the bias of each on a bandit):

| name | subtracts | divides by |
|---|---|---|
| gae | the critic's V(s_t), through the TD residuals | nothing |
| reinforce | V(s_t), or the batch mean of G_t | nothing |
| rloo | the mean of the other responses to the prompt | nothing |
| grpo | the group mean (the response's own reward included) | the group's std |
| dr_grpo | the group mean | nothing |
| reinforce_pp | the batch mean of G_t | the batch std of G_t |
| reinforce_pp_baseline | the group mean of the score, then the batch mean | the batch std |
"""

from __future__ import annotations

import difflib
import functools
import inspect
import numbers
from collections.abc import Callable

import torch

from ._checks import check_float, check_mask, check_range, check_same_shape, check_tensor
from .gae import compute_gae
from .masked import masked_mean, masked_whiten
from .policy_gradient import discounted_returns
from .registry import Registry
from .shaping import last_real_index

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# The keywords `objective.Objective` passes to every estimator; each uses those it needs and ignores the rest.
COMMON_KEYWORDS = ("values", "group_ids", "scores", "gamma", "lam")


def _checked(name: str, fn: AdvantageEstimator) -> AdvantageEstimator:
    """`fn` as the registry hands it out: a keyword that neither it nor the common interface
    knows (a misspelt `lamda`, which `**_` would swallow) is an error that names it, and `gamma`
    and `lam` must lie in [0, 1] even where the estimator does not use them."""
    own = {p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    known = sorted(own | set(COMMON_KEYWORDS))

    @functools.wraps(fn)
    def estimator(rewards, mask, **kwargs):
        for key in kwargs:
            if key not in known:
                near = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise TypeError(f"advantage estimator {name!r} got an unknown keyword {key!r}{hint} (it takes {', '.join(known)})")
        for key in ("gamma", "lam"):
            if kwargs.get(key) is not None:
                check_range(key, kwargs[key], 0.0, 1.0)
        return fn(rewards, mask, **kwargs)

    return estimator


#: The advantage estimators by name (`advantage.estimator`), a `Registry`; it hands out each
#: estimator checked (`_checked`).
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", wrap=_checked)
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = ADVANTAGE_ESTIMATORS.lookup


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
    index, counts = _groups(group_ids, rewards.shape[0], rewards.device)
    totals = torch.where(m.bool(), rewards, torch.zeros_like(rewards)).sum(dim=-1)
    return totals, index, counts, m


def _groups(group_ids, n: int, device):
    """(index, counts): each response's group index (n,) and the group sizes (G,), checked."""
    if group_ids is None:
        raise ValueError("group estimators need `group_ids`: a (B,) id of each response's prompt")
    if not isinstance(group_ids, torch.Tensor):
        ids = list(group_ids)
        if not all(isinstance(g, numbers.Integral) and not isinstance(g, bool) for g in ids):  # e.g. the prompts' texts
            kinds = sorted({type(g).__name__ for g in ids})
            raise ValueError(f"`group_ids` must be integers, one per response ({', '.join(kinds)} given): number the prompts, e.g. with a dict from prompt to index")
        group_ids = ids
    group_ids = torch.as_tensor(group_ids, device=device)
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"`group_ids` must be integers, one per response (a {group_ids.dtype} tensor given)")
    if group_ids.shape != (n,):
        raise ValueError(f"`group_ids` has shape {tuple(group_ids.shape)}; expected ({n},), one id per response")
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        raise ValueError(
            "every group in `group_ids` needs at least 2 responses (the others are the "
            f"baseline); group sizes found: {sorted(set(counts.tolist()))}"
        )
    return index, counts


def _group_sum(values: torch.Tensor, index: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(G,) the sum of (B,) `values` over each group (`index` and `counts` from `_groups`)."""
    return torch.zeros(counts.shape, dtype=values.dtype, device=values.device).index_add_(0, index, values)


@register_advantage_estimator("rloo")
def rloo_estimator(rewards, mask, *, group_ids=None, **_):
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024).

    A_i = R_i - mean_{j in group(i), j != i} R_j, broadcast over the tokens of response i;
    returns are R_i. Leaving i out keeps the baseline independent of response i's own sample,
    so the estimate stays unbiased.
    """
    totals, index, counts, m = _group_totals(rewards, mask, group_ids)
    ### BEGIN SOLUTION grpo
    n = counts[index].to(totals.dtype)
    baseline = (_group_sum(totals, index, counts)[index] - totals) / (n - 1)
    advantages = (totals - baseline)[:, None] * m
    ### END SOLUTION
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
    ### BEGIN SOLUTION grpo
    n = counts.to(totals.dtype)
    mean = _group_sum(totals, index, counts) / n
    std = torch.sqrt(_group_sum((totals - mean[index]) ** 2, index, counts) / (n - 1))
    advantages = totals - mean[index]
    if norm_by_std:
        eps = check_range("eps", eps, low=0.0)
        advantages = advantages / (std[index] + eps)
    advantages = advantages[:, None] * m
    ### END SOLUTION
    return advantages, totals[:, None] * m


@register_advantage_estimator("dr_grpo")
def dr_grpo_estimator(rewards, mask, *, group_ids=None, **_):
    """Dr. GRPO's advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training"):
    A_i = R_i - mean_group R, with no division by the group's std; returns are R_i.

    The paper's other half is the length handling: each sequence's token sum divided by one
    constant (the generation budget), not by its own length, which is `loss_agg =
    "seq-mean-token-sum-norm"` (the `dr_grpo` preset sets both).
    """
    return grpo_estimator(rewards, mask, group_ids=group_ids, norm_by_std=False)


@register_advantage_estimator("reinforce_pp")
def reinforce_pp_estimator(rewards, mask, *, gamma=1.0, **_):
    """REINFORCE++ (Hu et al. 2025): the return-to-go G_t of the per-token rewards (the KL
    penalty of every later token included), normalised over the real tokens of the whole batch:
    A_t = (G_t - mean G) / std G; returns are G_t. No critic and no group: one prompt, one
    response is enough. Applying the trainer's `advantage.whiten` afterwards changes nothing.
    """
    returns = discounted_returns(rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


@register_advantage_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline_estimator(rewards, mask, *, group_ids=None, scores=None, gamma=1.0, **_):
    """REINFORCE++-baseline (Hu et al. 2025; OpenRLHF's `reinforce_baseline`): the group mean of
    the scalar score is subtracted from the score on the last real token, before any KL penalty
    is counted; then the return-to-go is normalised over the batch like `reinforce_pp`
    ("group mean, batch std"). The batch std replaces GRPO's per-group std, so a prompt whose
    responses nearly all agree is not blown up to unit scale. Needs `scores` (B,): the scores
    that `rewards` places on each response's last real token.
    """
    if scores is None:
        raise ValueError("the 'reinforce_pp_baseline' advantage estimator needs `scores`: the (B,) scalar score of each response")
    check_tensor("rewards", rewards, ndim=2)
    check_float(rewards=rewards)
    m = check_mask(mask, rewards, "rewards")
    scores = torch.as_tensor(scores, device=rewards.device, dtype=rewards.dtype)
    if scores.shape != rewards.shape[:1]:
        raise ValueError(f"`scores` has shape {tuple(scores.shape)}; expected ({rewards.shape[0]},), one score per response")
    index, counts = _groups(group_ids, rewards.shape[0], rewards.device)
    group_mean = _group_sum(scores, index, counts) / counts.to(scores.dtype)
    centred = rewards.clone()  # the score's baseline comes off where the score sits: the last real token
    centred[torch.arange(rewards.shape[0], device=rewards.device), last_real_index(m)] -= group_mean[index]
    returns = discounted_returns(centred, mask, gamma)
    return masked_whiten(returns, mask), returns
