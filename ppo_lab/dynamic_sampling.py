"""DAPO's dynamic sampling: keep only the groups that teach something.

Chapter 10 (Beyond PPO) uses it. With a group estimator (GRPO, Dr. GRPO, RLOO) every response
of a prompt is compared with its siblings; when all of them got the same score (all right, or all
wrong, as most groups are on a task the model finds easy or hopeless) every advantage of the
group is 0, and its tokens only dilute the minibatch (with token-mean aggregation they still
count in the normaliser) and add no gradient. DAPO (Yu et al. 2025) drops such groups and samples
more prompts until the batch is full of informative ones, so every step has its full number of
useful responses; the price is more sampling per update.

`informative_groups` is the filter; `PPOTrainer.collect` draws rollouts until enough groups
pass it. verl's recipe stops the run with an error after `max_num_gen_batches` rollouts; here
the batch is then filled with the dropped groups instead (their advantages are 0 under a group
estimator), and `sampling/informative_frac` shows how often that happens.
"""

from __future__ import annotations

import torch

from ._checks import check_tensor


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
