"""Public checks of assignment 'gae': GAE over the real tokens, and whitening (chapters 2, 4)."""

import torch
from _grading import close, expect, graded, lab, right_padded, slow_gae, slow_whiten


@graded("compute_gae", 2)
def test_gae_matches_the_recursion_without_padding():
    """on responses without padding, advantages and returns follow A_t = delta_t + gamma lam A_{t+1}"""
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.8)):
        adv, ret = lab().compute_gae(r, v, mask, gamma, lam)
        want_adv, want_ret = slow_gae(r, v, mask, gamma, lam)
        close(adv, want_adv, f"advantages (gamma {gamma}, lam {lam})")
        close(ret, want_ret, f"returns (gamma {gamma}, lam {lam}); they are A_t + V(s_t), the lambda-returns")


@graded("compute_gae", 1)
def test_lambda_zero_and_one():
    """lam = 0 gives the one-step TD error, lam = 1 the Monte Carlo return minus V"""
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    mask = torch.ones(2, 5)
    next_v = torch.cat([v[:, 1:], torch.zeros(2, 1)], dim=1)
    adv0, _ = lab().compute_gae(r, v, mask, 1.0, 0.0)
    close(adv0, r + next_v - v, "lam = 0: the advantage should be the TD error r_t + V(s_{t+1}) - V(s_t)")
    adv1, _ = lab().compute_gae(r, v, mask, 1.0, 1.0)
    mc = torch.flip(torch.cumsum(torch.flip(r, [1]), 1), [1])
    close(adv1, mc - v, "lam = 1, gamma = 1: the advantage should be the reward-to-go minus V(s_t)")


@graded("compute_gae", 2)
def test_gae_ignores_what_padding_holds():
    """advantages and returns ignore whatever is stored at padded positions"""
    g = torch.Generator().manual_seed(2)
    mask = right_padded([6, 3, 1, 4], 6)
    r, v = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    junk_r = torch.where(mask > 0, r, torch.randn(4, 6, generator=g) * 100)
    junk_v = torch.where(mask > 0, v, torch.randn(4, 6, generator=g) * 100)
    clean, _ = lab().compute_gae(r, torch.where(mask > 0, v, torch.zeros_like(v)), mask, 1.0, 0.95)
    dirty, _ = lab().compute_gae(junk_r, junk_v, mask, 1.0, 0.95)
    change = ((dirty - clean) * mask).abs()
    if float(change.max()) > 1e-4:
        b, t = (int(i) for i in torch.nonzero(change == change.max())[0])
        expect(False, f"advantages changed when only the values and rewards stored at padded positions changed "
               f"(by {float(change.max()):.3g} at row {b}, position {t}): the episode ends at the last real token, "
               "so V after it is 0 and nothing past it may enter delta")
    want, want_ret = slow_gae(r, v, mask, 1.0, 0.95)
    adv, ret = lab().compute_gae(junk_r, junk_v, mask, 1.0, 0.95)
    close(adv * mask, want, "advantages of right-padded responses")
    close(ret * mask, want_ret, "returns of right-padded responses")


@graded("masked_whiten", 2)
def test_whitening_gives_mean_zero_std_one():
    """whitened values have mean 0 and (unbiased) standard deviation 1"""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, generator=g) * 3 + 2
    mask = torch.ones(4, 5)
    out = lab().masked_whiten(x, mask)
    close(out, slow_whiten(x, mask), "whitened values")


@graded("masked_whiten", 2)
def test_whitening_ignores_padding():
    """whitening takes its mean and variance over the real tokens only, and leaves padding at 0"""
    g = torch.Generator().manual_seed(4)
    mask = right_padded([5, 2, 4], 5)
    x = torch.where(mask > 0, torch.randn(3, 5, generator=g) * 3 + 2, torch.zeros(3, 5))
    out = lab().masked_whiten(x, mask)
    alone = lab().masked_whiten(x[mask > 0][None, :], torch.ones(1, int(mask.sum())))[0]
    expect(out.shape == x.shape and torch.allclose(out[mask > 0].double(), alone.double(), atol=1e-5),
           f"whitening the padded batch gave {[round(float(v), 4) for v in out[mask > 0]]} at its real tokens, but whitening those "
           f"real values alone gave {[round(float(v), 4) for v in alone]}: the mean and variance must come from the real tokens only")
    expect(bool((out[mask == 0] == 0).all()), f"padded positions should hold 0 after whitening, got {out.tolist()}")
