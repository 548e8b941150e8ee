"""Hidden checks of assignment 'gae'."""

import torch
from _grading import close, expect, graded, lab, right_padded


@graded("compute_gae", 1)
def test_padding_is_zero():
    """advantages and returns are 0 at padded positions"""
    mask = right_padded([2, 4], 4)
    adv, ret = lab().compute_gae(torch.ones(2, 4), torch.full((2, 4), 0.5), mask, 1.0, 0.9)
    expect(bool((adv[mask == 0] == 0).all()) and bool((ret[mask == 0] == 0).all()),
           f"padded positions should hold 0; advantages {adv.tolist()}, returns {ret.tolist()}")


@graded("compute_gae", 1)
def test_one_token_response():
    """a one-token response (the bandit case): A = r - V, return r"""
    adv, ret = lab().compute_gae(torch.tensor([[1.0]]), torch.tensor([[0.3]]), torch.ones(1, 1), 1.0, 0.95)
    close(adv, torch.tensor([[0.7]]), "advantage of r = 1, V = 0.3")
    close(ret, torch.tensor([[1.0]]), "return of r = 1, V = 0.3")


@graded("masked_whiten", 1)
def test_shift_mean_false_keeps_the_mean():
    """shift_mean = False scales to std 1 and keeps the mean"""
    g = torch.Generator().manual_seed(5)
    x, mask = torch.randn(3, 4, generator=g) + 1.5, torch.ones(3, 4)
    close(lab().masked_whiten(x, mask, shift_mean=False), lab().masked_whiten(x, mask) + x.mean(),
          "whitening with shift_mean=False: the whitened values plus the mean of x")


@graded("masked_whiten", 1)
def test_float16_does_not_overflow():
    """float16 values of a few hundred are whitened without overflow, and stay float16"""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(4, 8, generator=g) * 300).half()
    out = lab().masked_whiten(x, torch.ones(4, 8))
    expect(out.dtype == torch.float16, f"float16 input should give float16 output, got {out.dtype}")
    expect(bool(torch.isfinite(out).all()) and float(out.float().abs().max()) > 0.1,
           "float16 values near 300 whitened to inf, nan or zeros: their variance (~1e5) overflows float16; compute in float32")
