"""DAPO's dynamic sampling: keep only the groups that teach something.

Chapter 10 (Beyond PPO) uses it. With a group estimator (GRPO, Dr. GRPO, RLOO) every response
of a prompt is compared with its siblings; when all of them got the same score (all right, or all
wrong, as most groups are on a task the model finds easy or hopeless) every advantage of the
group is 0, and its tokens only dilute the minibatch (with token-mean aggregation they still
count in the normaliser) and add no gradient. DAPO (Yu et al. 2025) drops such groups and samples
more prompts until the batch is full of informative ones, so every step has its full number of
useful responses; the price is more sampling per update.

`informative_groups` is the filter; `DynamicSampling.collect` draws rollouts until enough groups
pass it, and `OneRollout.collect` is the plain PPO rollout the trainer calls in its place. verl's recipe stops the run with an error after `max_num_gen_batches` rollouts; here
the batch is then filled with the dropped groups instead (their advantages are 0 under a group
estimator), and `dynamic_sampling/informative_frac` shows how often that happens.
"""

from __future__ import annotations

import torch

from ._checks import check_tensor
from .batch import Rollout, cat_rollouts


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(B,) bool: whether the group of each response has scores that are not all equal.

    Args:
        scores: (B,) each response's score.
        group_ids: (B,) the id of each response's prompt.

    A group with a nan or an inf is kept, so that the trainer's health check sees the bad score
    instead of the filter hiding it.
    """
    check_tensor("scores", scores, ndim=1)
    group_ids = torch.as_tensor(group_ids, device=scores.device)
    if group_ids.shape != scores.shape:
        raise ValueError(f"`group_ids` has shape {tuple(group_ids.shape)}; expected {tuple(scores.shape)}, one id per score")
    _, index = torch.unique(group_ids, return_inverse=True)
    g = int(index.max()) + 1 if len(index) else 0
    s = scores.double()
    high = torch.full((g,), float("-inf"), dtype=s.dtype, device=s.device).scatter_reduce(0, index, s, "amax")
    low = torch.full((g,), float("inf"), dtype=s.dtype, device=s.device).scatter_reduce(0, index, s, "amin")
    bad = torch.zeros(g, dtype=torch.uint8, device=s.device).scatter_reduce(0, index, (~torch.isfinite(s)).to(torch.uint8), "amax")
    return (bad.bool() | (high != low))[index]


class OneRollout:
    """The usual collection: one rollout of the next prompts, and no dynamic_sampling/* metrics."""

    def collect(self, rollout, next_prompts, pad_id: int) -> tuple[Rollout, dict[str, float]]:
        """`rollout(prompts, attempt)` of `next_prompts()`; `pad_id` is unused."""
        return rollout(next_prompts(), 0), {}


class DynamicSampling:
    """DAPO's collection: rollouts are drawn until `groups` informative groups (of `group_size`
    responses each, whose raw scores are not all equal, as verl's default `metric: acc`) are in
    hand, at most `max_rounds` of them. The first informative groups make the batch; the ones
    beyond it are discarded (as in verl), and a batch still short is filled with dropped groups,
    earliest first. Rows of different rollouts are padded to a common width after they were
    scored at their own, so the first step's ratio is 1 to float round-off rather than exactly."""

    def __init__(self, group_size: int, groups: int, max_rounds: int):
        self.group_size, self.groups, self.max_rounds = group_size, groups, max_rounds

    def collect(self, rollout, next_prompts, pad_id: int) -> tuple[Rollout, dict[str, float]]:
        """The batch, and its dynamic_sampling/* metrics. `rollout(prompts, attempt)` samples and scores
        (attempt > 0 draws other tokens), `next_prompts()` gives the next prompts, `pad_id` pads."""
        k, needed = self.group_size, self.groups
        kept: list[Rollout] = []  # each round's informative groups that the batch can still use
        dropped: list[Rollout] = []  # and its other groups, as many as could be needed to fill it
        n_kept = n_dropped = drawn = informative = 0
        score_sum = 0.0
        for attempt in range(self.max_rounds):
            ro = rollout(next_prompts(), attempt)
            keep = informative_groups(ro.scores, ro.group_ids).view(-1, k)[:, 0]  # (groups,): a group's responses are adjacent
            drawn, informative = drawn + len(keep), informative + int(keep.sum())
            score_sum += ro.scores.double().sum().item()
            groups = torch.arange(len(ro), device=ro.mask.device).view(-1, k)
            # only the rows that can still be used are kept, the rest of the round is freed
            good, bad = groups[keep][: needed - n_kept], groups[~keep][: needed - n_kept - n_dropped]
            if len(good):
                kept.append(cat_rollouts([(ro, good.flatten())], pad_id))
            if len(bad):
                dropped.append(cat_rollouts([(ro, bad.flatten())], pad_id))
            n_kept, n_dropped = n_kept + len(good), n_dropped + len(bad)
            del ro
            if n_kept >= needed:
                break
        fill = needed - n_kept  # groups still missing: the earliest dropped ones
        parts = [(part, torch.arange(len(part), device=part.mask.device)) for part in kept]
        for part in dropped:
            if fill <= 0:
                break
            take = min(fill, len(part) // k)
            parts.append((part, torch.arange(take * k, device=part.mask.device)))
            fill -= take
        return cat_rollouts(parts, pad_id), {
            "dynamic_sampling/responses": float(drawn * k), "dynamic_sampling/rounds": float(attempt + 1), "dynamic_sampling/informative_frac": informative / drawn,
            "dynamic_sampling/score_mean": score_sum / (drawn * k),
        }


def collector(dynamic: bool, group_size: int, groups: int, max_rounds: int) -> OneRollout | DynamicSampling:
    """The collection a run uses: DAPO's dynamic sampling of `groups` groups of `group_size`
    responses when `dynamic`, else one rollout."""
    return DynamicSampling(group_size, groups, max_rounds) if dynamic else OneRollout()
