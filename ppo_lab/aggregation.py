"""How per-token losses become one number: loss aggregation modes.

Chapter 10 (Beyond PPO) compares them. The choice changes how much each token and each sequence
weighs in the gradient, and the big implementations differ:

- "token-mean": every real token in the batch weighs the same (PPO as in TRL, verl's default,
  DAPO). Long responses get more total weight than short ones.
- "seq-mean-token-mean": average within each sequence, then over sequences (the original GRPO
  paper). Every sequence weighs the same, so a token of a short response weighs more than a
  token of a long one: the length bias Dr. GRPO points out.
- "seq-mean-token-sum": sum within each sequence, then average over sequences. This is the
  Monte Carlo estimate of the policy-gradient objective itself (chapter 2), unbiased but its
  scale grows with response length.
- "seq-mean-token-sum-norm": sum within each sequence divided by one fixed length L (the
  generation budget), then average (Dr. GRPO, Liu et al. 2025): no per-sequence length
  normaliser, and a constant scale.

Split invariance, decided on purpose. A minibatch is split into micro-batches (gradient
accumulation) and across processes; averaging the micro-batches' means (each divided by the
number of micro-batches, as TRL and verl long did) weighs a token of a micro-batch with few
tokens more than one of a micro-batch with many, so the gradient depends on how the minibatch
happened to be split (the bug class behind TRL's gradient-accumulation reports). `ppo_lab`
weighs each micro-batch's aggregate by `micro_batch_weight`: its share of the minibatch's
normaliser (tokens for token-mean, sequences otherwise), so the weighted sum over any split is
the aggregate of the whole minibatch, and so is its gradient (property-tested).
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_float, check_mask, check_nonempty_mask, check_range, check_tensor

#: The ways `aggregate_loss` turns per-token losses into one number (`loss.aggregation`).
AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str = "token-mean",
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over the real tokens.

    Args:
        loss: (B, T) per-token loss.
        mask: (B, T) 1 on real response tokens.
        loss_agg: one of `AGGREGATION_MODES` (see the module docstring).
        norm_length: the constant L of "seq-mean-token-sum-norm"; defaults to T.

    Returns:
        0-dim tensor. With n_b = sum_t mask[b, t] and s_b = sum_t mask[b, t] * loss[b, t]:
        token-mean = sum_b s_b / sum_b n_b; seq-mean-token-sum = mean_b s_b;
        seq-mean-token-mean = mean_b (s_b / n_b); seq-mean-token-sum-norm = mean_b s_b / L.
    """
    check_tensor("loss", loss, ndim=2)
    check_float(loss=loss)
    m = check_mask(mask, loss, "loss")
    check_choice("loss aggregation mode", loss_agg, AGGREGATION_MODES)
    per_token = torch.where(m.bool(), loss, torch.zeros_like(loss))
    if loss_agg == "token-mean":
        check_nonempty_mask(m, "a token-mean")
        return per_token.sum() / m.sum()
    seq_sum = per_token.sum(dim=-1)  # (B,)
    if loss_agg == "seq-mean-token-sum":
        return seq_sum.mean()
    if loss_agg == "seq-mean-token-mean":
        check_nonempty_mask(m, "a per-sequence token mean", dim=-1)
        return (seq_sum / m.sum(dim=-1)).mean()
    length = loss.shape[-1] if norm_length is None else norm_length
    length = check_range("norm_length", length, low=0.0, low_open=True)
    return seq_sum.mean() / length


def aggregation_count(mask: torch.Tensor, loss_agg: str = "token-mean") -> torch.Tensor:
    """The normaliser `aggregate_loss` divides by, as a count: the real tokens of `mask` (B, T)
    for "token-mean", its sequences (B) for the seq-mean modes. 0-dim tensor."""
    check_tensor("mask", mask, ndim=2)
    check_choice("loss aggregation mode", loss_agg, AGGREGATION_MODES)
    m = check_mask(mask, mask, "mask")
    return m.sum() if loss_agg == "token-mean" else torch.tensor(float(m.shape[0]), device=m.device)


def micro_batch_weight(micro_mask: torch.Tensor, minibatch_mask: torch.Tensor, loss_agg: str = "token-mean", processes: int = 1) -> torch.Tensor:
    """The factor that turns a micro-batch's `aggregate_loss` into its share of the minibatch's.

    Args:
        micro_mask: (b, T) the mask of this process's micro-batch.
        minibatch_mask: (B, T) the mask of the whole minibatch, over all micro-batches and processes.
        loss_agg: the aggregation mode.
        processes: data-parallel processes, whose gradients DDP averages (divides by their number).

    Returns:
        0-dim tensor, processes x count(micro) / count(minibatch) with `aggregation_count`
        (a tensor, so that the training loop does not wait for the device). Summed over the
        micro-batches of a minibatch (and averaged over processes, as DDP does), the weighted
        aggregates equal the aggregate of the whole minibatch, for any split. With one process
        and one micro-batch it is exactly 1.
    """
    return processes * aggregation_count(micro_mask, loss_agg) / aggregation_count(minibatch_mask, loss_agg)
