"""Statistics over real response tokens only, and the response mask itself.

Used from chapter 2 on. A batch of responses is a (B, T) tensor padded to a common length; the
mask is 1 on real response tokens (the end-of-sequence token included) and 0 on padding. Every
mean, variance and whitening in PPO must ignore the padding, or short responses get diluted and
padding garbage leaks into the loss.
"""

from __future__ import annotations

import torch

from ._checks import check_float, check_mask, check_nonempty_mask, check_tensor, value_checks_on

# Sums over a batch overflow float16 (largest finite value 65504: a sum of squares of values
# around 100 over a few tokens, or a mask count past 65504 tokens) and lose precision in both
# half formats (bf16 counts only up to 256 exactly), so the statistics of half-precision input
# are taken in float32 and the result is cast back. float32 and float64 are computed in their
# own dtype, exactly as before.
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _upcast(x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, m) in float32 when x is half precision, else unchanged."""
    if x.dtype in _LOW_PRECISION:
        return x.float(), m.float()
    return x, m


def _mean(x: torch.Tensor, m: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Masked mean of checked `x` and 0/1 `m` (same dtype), in that dtype."""
    # where() rather than x * m: 0 * inf and 0 * nan are nan, and padding may hold either.
    xm = torch.where(m.bool(), x, torch.zeros_like(x))
    if dim is None:
        return xm.sum() / m.sum()
    return xm.sum(dim=dim) / m.sum(dim=dim)


def _var(x: torch.Tensor, m: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """Masked variance of checked `x` and 0/1 `m` (same dtype), in that dtype."""
    n = m.sum()
    mean = _mean(x, m)
    centered = torch.where(m.bool(), x - mean, torch.zeros_like(x))
    return (centered**2).sum() / (n - 1 if unbiased else n)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is 1.

    Args:
        x: (B, T) values (any shape works, as long as `mask` has the same one).
        mask: (B, T) 1 on real response tokens, 0 on padding.
        dim: None for one mean over every real token in the batch (a 0-dim tensor), or the
            dimension to reduce (dim=-1 gives a (B,) mean per sequence).

    Naive equivalent: `x[mask.bool()].mean()` for dim=None. Positions where mask is 0 do not
    influence the result even if they hold inf or nan.

    Raises ValueError if the mask selects nothing (overall, or in some row when dim is given).
    Half-precision input is summed in float32 and the mean returned in the input's dtype.
    """
    check_float(x=x)
    m = check_mask(mask, x)
    check_nonempty_mask(m, "a masked mean", dim=dim)
    return _mean(*_upcast(x, m), dim=dim).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over the real positions, as a 0-dim tensor.

    Args:
        x: (B, T) values.
        mask: (B, T) 1 on real response tokens.
        unbiased: divide by n - 1 (Bessel's correction) instead of n, n = number of real tokens.

    Naive equivalent: `x[mask.bool()].var(unbiased=unbiased)`.

    Raises ValueError if fewer than 2 real tokens are selected with unbiased=True (or none at all).
    Half-precision input is reduced in float32 (a float16 sum of squares overflows at 65504) and
    the variance returned in the input's dtype.
    """
    check_float(x=x)
    m = check_mask(mask, x)
    check_nonempty_mask(m, "a masked variance")
    if unbiased and value_checks_on() and bool(m.sum() < 2):
        raise ValueError(
            "`mask` selects a single real token; the unbiased variance needs at least 2 "
            "(pass unbiased=False, or a larger batch)"
        )
    return _var(*_upcast(x, m), unbiased).to(x.dtype)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise `x` to unit variance (and zero mean) over the real positions.

    Args:
        x: (B, T) values, typically advantages.
        mask: (B, T) 1 on real response tokens.
        shift_mean: subtract the mean (True) or keep it, scaling only (False). TRL keeps the mean
            when whitening rewards, so that the sign of the KL penalty survives.
        eps: added to the variance before the square root.

    Returns:
        (B, T) tensor: (x - mean) / sqrt(var + eps) at real positions (mean added back when
        shift_mean=False), 0 at padding. Mean and unbiased variance are taken over the real
        tokens of the whole batch, so the result has mean 0 and (unbiased) std 1 over the mask.
        Half-precision input is whitened in float32 and the result cast back to its dtype (in
        float16 the variance of values beyond about +-256 would overflow to inf, and the
        result to all zeros).
    """
    check_float(x=x)
    m = check_mask(mask, x)
    ### BEGIN SOLUTION gae
    # The public functions for their checks (no real token, a single one); on the upcast
    # copies, so that half-precision input is whitened in float32 and only the result is cast.
    xc, mc = _upcast(x, m)
    mean, var = masked_mean(xc, mc), masked_var(xc, mc)
    white = (xc - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return torch.where(mc.bool(), white, torch.zeros_like(white)).to(x.dtype)
    ### END SOLUTION


def response_mask(
    response_ids: torch.Tensor, eos_token_id: int | list[int] | None, stop_after: int = 0
) -> torch.Tensor:
    """Mask of the real tokens of right-padded responses: up to and including the first EOS.

    Args:
        response_ids: (B, T) generated token ids, right-padded after the end of each response.
        eos_token_id: the stop token id, a list of stop ids, or None (no stop token: every
            position is real).
        stop_after: a stop token counts only at position >= stop_after (0-based); one before
            it is an ordinary token (OpenAI 2019's truncation window, `sampling.stop_after`).

    Returns:
        (B, T) float mask: 1 from the start through the first stop token, 0 after it. A response
        that never stops (it filled the token budget) is all ones.

    This never looks at the pad token, on purpose. When pad == eos (GPT-2 and many models
    whose tokenizer has no pad token), `tokens != pad_token_id` also removes the real EOS, so
    the last real token, where the score belongs, is lost: the off-by-one AlpacaFarm warns about
    in its `_shape_reward`. Finding the first EOS is correct whatever the padding holds.

    Example: tokens [[5, 7, 2, 2, 2]] with eos 2 -> [[1, 1, 1, 0, 0]].
    """
    check_tensor("response_ids", response_ids, ndim=2)
    if eos_token_id is None:
        return torch.ones_like(response_ids, dtype=torch.float32)
    ### BEGIN SOLUTION logprobs
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    is_eos = torch.isin(response_ids, torch.tensor(ids, device=response_ids.device))
    if stop_after:
        is_eos = is_eos & (torch.arange(response_ids.shape[1], device=response_ids.device) >= stop_after)
    # eos_seen[t] counts stop tokens strictly before t: position t is real until one was seen.
    eos_seen = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()
    return (eos_seen == 0).float()
    ### END SOLUTION
