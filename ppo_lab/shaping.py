"""Per-token rewards for RLHF: the KL penalty at every token, the score at the last one.

Chapter 5 (Reward shaping and the KL penalty) explains it. The reward model gives one scalar
per response; PPO needs a reward per token. Following Ziegler et al. (2019) and Stiennon et al.
(2020), each real response token t gets

    r_t = -beta * KL_t                          (KL_t from `kl_penalty`)

and the last real token additionally gets the sequence score (optionally clipped to
[-score_clip, score_clip], as DeepSpeed-Chat does).

Where the score sits, decided on purpose: on the LAST REAL TOKEN, the EOS token when the
response has one, the last generated token when it ran out of budget. That is the token whose
choice completed the response the reward model judged, it is the last position with a log-prob
and a value, and it is where verl, OpenRLHF and AlpacaFarm put it. TRL's PPOTrainer (and
DeepSpeed-Chat, via its `ends` index) put it one position past the last non-pad token, which
lands on a padding position that TRL then keeps in the mask (trl issues #1893, #3750), so the
score is credited to a token that was never generated; AlpacaFarm's own comment notes that its
`(responses != pad_token_id).sum() - 1` lands one position early when pad == eos. Here the
position comes from the mask alone (see `response_mask`, which finds the first EOS and never
compares against the pad id), so pad == eos cannot shift it.
"""

from __future__ import annotations

import torch

from ._checks import (
    check_float,
    check_mask,
    check_nonempty_mask,
    check_range,
    check_same_shape,
    check_tensor,
    value_checks_on,
)
from .kl import kl_penalty


def last_real_index(mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last position with mask 1 in each row of a (B, T) mask.

    Raises ValueError if a row has no real token (there is nowhere to put its score).
    """
    check_tensor("mask", mask, ndim=2)
    m = check_mask(mask, mask, "mask")
    check_nonempty_mask(m, "the last real token", dim=-1)
    ### BEGIN SOLUTION shaping
    positions = torch.arange(m.shape[1], device=m.device)
    return torch.where(m.bool(), positions, -1).max(dim=-1).values
    ### END SOLUTION


def shape_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kl_estimator: str = "k1",
    score_clip: float | None = None,
) -> torch.Tensor:
    """Per-token rewards: -kl_coef * KL at every real token, plus the score at the last one.

    Args:
        scores: (B,) one scalar per response from the reward model or function.
        logprobs: (B, T) log-probs of the response tokens under the policy that sampled them.
        ref_logprobs: (B, T) log-probs of the same tokens under the reference policy.
        mask: (B, T) 1 on real response tokens (EOS included), 0 on padding.
        kl_coef: beta >= 0.
        kl_estimator: KL estimator, "k1" (the usual choice in the reward), "k2", "k3" or "abs".
        score_clip: if given, scores are clipped to [-score_clip, score_clip] first.

    Returns:
        (B, T) rewards, zero on padding.

    Example: scores [2.0], mask [[1, 1, 0]], logprobs - ref_logprobs = [[0.1, 0.3, 9.9]],
    kl_coef 0.5 -> [[-0.05, 1.85, 0.0]].
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    check_tensor("logprobs", logprobs, ndim=2)
    check_tensor("scores", scores, ndim=1)
    check_float(scores=scores, logprobs=logprobs, ref_logprobs=ref_logprobs)
    if scores.shape[0] != logprobs.shape[0]:
        raise ValueError(
            f"`scores` has {scores.shape[0]} entries but the batch has {logprobs.shape[0]} "
            "responses; expected one score per response, shape (B,)"
        )
    if value_checks_on() and not bool(torch.isfinite(scores).all()):
        rows = torch.nonzero(~torch.isfinite(scores)).flatten()[:5].tolist()
        raise ValueError(f"`scores` contain nan or inf at response(s) {rows}")
    m = check_mask(mask, logprobs, "logprobs")
    kl_coef = check_range("kl_coef", kl_coef, low=0.0)
    if score_clip is not None:
        c = check_range("score_clip", score_clip, low=0.0, low_open=True)
        scores = scores.clamp(-c, c)
    ### BEGIN SOLUTION shaping
    last = last_real_index(m)  # (B,)
    kl = kl_penalty(logprobs, ref_logprobs, kl_estimator)
    rewards = torch.where(m.bool(), -kl_coef * kl, torch.zeros_like(kl))
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards
    ### END SOLUTION


def adjust_scores(
    scores: torch.Tensor,
    ended: torch.Tensor | None = None,
    truncated_penalty: float | None = None,
    normalize: bool = False,
    eps: float = 1e-8,
    *,
    truncated_score: float | None = None,
    gain: float = 1.0,
    bias: float = 0.0,
) -> torch.Tensor:
    """The score corrections applied before shaping, in this order.

    Args:
        scores: (B,) raw scores from the reward.
        ended: (B,) bool, whether each response ended with a stop token (needed with a
            penalty or a replacement score).
        truncated_penalty: if given, subtracted from the score of every response that ran out
            of tokens without stopping (TRL's `missing_eos_penalty`): a reward model judges
            truncated text as if it were finished, and the policy learns to ramble otherwise.
        normalize: rescale the batch to mean 0, std 1 (unbiased), which keeps the reward's
            scale from setting the effective learning rate.
        truncated_score: if given, the score of every response without a stop token is
            replaced by this value (the "EOS trick" of OpenAI 2019 and N+, which use -1): unlike
            a penalty, it does not depend on what the reward model made of the truncated text.
        gain, bias: a fixed affine map applied first, `gain * score + bias` (see
            `reference_normalization`: OpenAI 2019 fixes them once so that the reference
            policy's responses score mean 0 and std 1). The replacement score and the penalty
            are on the normalised scale, as in the recipes.

    Returns:
        (B,) adjusted scores (a new tensor).

    Example: scores [1.0, 2.0], ended [True, False], penalty 1.0 -> [1.0, 1.0];
    with truncated_score -1.0 instead -> [1.0, -1.0].
    """
    check_tensor("scores", scores, ndim=1)
    check_float(scores=scores)
    if truncated_penalty is not None and truncated_score is not None:
        raise ValueError("give truncated_penalty or truncated_score, not both")
    out = scores * gain + bias
    if truncated_penalty is not None or truncated_score is not None:
        if ended is None or ended.shape != scores.shape:
            raise ValueError("`ended` must be a (B,) bool tensor when a truncated_penalty or truncated_score is given")
    if truncated_penalty is not None:
        penalty = check_range("truncated_penalty", truncated_penalty, low=0.0)
        out = torch.where(ended.bool(), out, out - penalty)
    if truncated_score is not None:
        out = torch.where(ended.bool(), out, torch.full_like(out, float(truncated_score)))
    if normalize:
        if out.numel() < 2:
            raise ValueError("normalizing scores needs at least 2 responses in the batch")
        out = (out - out.mean()) / (out.std() + eps)
    return out


def reference_normalization(scores: torch.Tensor, mode: str = "mean-std", eps: float = 1e-8) -> tuple[float, float]:
    """(gain, bias) such that `gain * scores + bias` has mean 0 (and std 1 for "mean-std").

    Args:
        scores: (N,) scores of the reference policy's responses, N >= 2.
        mode: "mean-std" (OpenAI 2019: mean 0, unbiased std 1) or "mean" (centre only, gain 1;
            N+ centres the SFT reference summaries at 0).

    Computed once before training and then fixed, unlike `adjust_scores(normalize=True)`,
    which re-centres every batch and so moves the critic's targets at every iteration.

    Example: scores [1.0, 3.0], "mean-std" -> gain 1/sqrt(2), bias -2/sqrt(2).
    """
    check_tensor("scores", scores, ndim=1)
    check_float(scores=scores)
    if mode not in ("mean-std", "mean"):
        raise ValueError(f"mode = {mode!r} is not allowed; valid values are: 'mean-std', 'mean'")
    if scores.numel() < 2:
        raise ValueError("reference_normalization needs at least 2 scores")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("reference_normalization got nan or inf scores from the reward")
    s = scores.double()
    mean, std = s.mean().item(), s.std().item()
    if mode == "mean-std" and std < 1e-12:
        raise ValueError(f"the {scores.numel()} reference scores are all equal ({mean:g}): there is no spread to scale to std 1; use mode 'mean'")
    gain = 1.0 / (std + eps) if mode == "mean-std" else 1.0
    return gain, -mean * gain


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the score.

    A response that runs into the last `buffer` tokens of its budget loses reward linearly, up to
    `factor` at the budget itself; a shorter one loses nothing:

        penalty(|y|) = factor * min(0, ((L_max - buffer) - |y|) / buffer),   |y| <= L_max,

    so -factor at |y| = L_max (a response cannot be longer: sampling stops there). The
    punishment is by length alone, so the policy learns to finish before the budget instead of
    being cut off, which a truncated response's reward (often 0 for a verifiable task) does not
    tell it. verl computes it in `DAPORewardManager`.

    Args:
        lengths: (B,) response lengths |y| in tokens (the stop token included).
        max_length: L_max, the generation budget (`max_new_tokens`).
        buffer: the length of the punished stretch, 1 <= buffer <= max_length.
        factor: the penalty at the budget, >= 0.

    Returns:
        (B,) float penalties in [-factor, 0].
    """
    check_tensor("lengths", lengths, ndim=1)
    if not 1 <= buffer <= max_length:
        raise ValueError(f"overlong buffer = {buffer!r} must be between 1 and the budget max_length = {max_length}")
    factor = check_range("factor", factor, low=0.0)
    lengths = lengths.to(torch.float32)
    if bool((lengths > max_length).any()):
        raise ValueError(f"a response of {int(lengths.max())} tokens is longer than the budget max_length = {max_length}")
    return factor * torch.clamp((max_length - buffer - lengths) / buffer, max=0.0)
