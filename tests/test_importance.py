import math

import pytest
import torch

import reference as ref
from conftest import DTYPES, SEEDS, random_mask, scribble
from ppo_lab import effective_sample_size, importance_weights


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_match_loops(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(4, 7, generator=g, dtype=torch.float64) * 0.3 - 2).to(dtype)
    old = (torch.randn(4, 7, generator=g, dtype=torch.float64) * 0.3 - 2).to(dtype)
    mask = random_mask(4, 7, g)
    tok = importance_weights(lp, old, mask, "token")
    seq = importance_weights(lp, old, mask, "sequence")
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for b, (l_row, o_row, m_row) in enumerate(zip(ref.rows(lp), ref.rows(old), ref.rows(mask))):
        log_seq = 0.0
        for t, (a, o, m) in enumerate(zip(l_row, o_row, m_row)):
            assert tok[b, t].item() == pytest.approx(math.exp(a - o) if m else 0.0, rel=tol)
            log_seq += (a - o) if m else 0.0
        assert seq[b].item() == pytest.approx(math.exp(log_seq), rel=tol)
    assert torch.equal(importance_weights(scribble(lp, mask, g), old, mask, "sequence"), seq)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("holes", [False, True])
def test_prefix_weights_match_loop(seed, dtype, holes):
    """level="prefix": the running product of the real tokens' ratios, 0 at padding."""
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(5, 9, generator=g, dtype=torch.float64) * 0.3 - 2).to(dtype)
    old = (torch.randn(5, 9, generator=g, dtype=torch.float64) * 0.3 - 2).to(dtype)
    mask = random_mask(5, 9, g, holes=holes)
    pre = importance_weights(lp, old, mask, "prefix")
    assert pre.shape == lp.shape and pre.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for b, (l_row, o_row, m_row) in enumerate(zip(ref.rows(lp), ref.rows(old), ref.rows(mask))):
        product = 1.0
        for t, (a, o, m) in enumerate(zip(l_row, o_row, m_row)):
            if m:
                product *= math.exp(a - o)
            assert pre[b, t].item() == pytest.approx(product if m else 0.0, rel=tol)
    # the first real token's weight is its token ratio, the last one's the sequence weight
    tok = importance_weights(lp, old, mask, "token")
    seq = importance_weights(lp, old, mask, "sequence")
    first = mask.argmax(dim=1)
    last = mask.shape[1] - 1 - mask.flip(1).argmax(dim=1)
    rows = torch.arange(5)
    torch.testing.assert_close(pre[rows, first], tok[rows, first])
    torch.testing.assert_close(pre[rows, last], seq)
    assert torch.equal(importance_weights(scribble(lp, mask, g), old, mask, "prefix"), pre)


def test_prefix_weights_example():
    lp = torch.tensor([[math.log(2), math.log(3), 5.0]])
    w = importance_weights(lp, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]), "prefix")
    torch.testing.assert_close(w, torch.tensor([[2.0, 6.0, 0.0]]))


def test_importance_sampling_estimate_is_unbiased():
    """E_old[w f] = E_new[f] for categorical policies, by Monte Carlo."""
    g = torch.Generator().manual_seed(0)
    old = torch.softmax(torch.tensor([0.2, 0.0, -0.5, 0.4]), 0)
    new = torch.softmax(torch.tensor([0.6, -0.2, -0.1, 0.1]), 0)
    f = torch.tensor([1.0, -2.0, 0.5, 3.0])
    x = torch.multinomial(old, 100000, replacement=True, generator=g)
    lp, old_lp = new.log()[x][:, None], old.log()[x][:, None]
    w = importance_weights(lp, old_lp, torch.ones_like(lp)).squeeze(1)
    estimate = (w * f[x]).mean()
    assert estimate.item() == pytest.approx((new * f).sum().item(), abs=0.03)


def test_ess_examples():
    assert effective_sample_size(torch.ones(4)).item() == pytest.approx(4.0)
    assert effective_sample_size(torch.tensor([1.0, 0, 0, 0])).item() == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([4.0, 1, 1, 1])).item() == pytest.approx(49 / 19)


@pytest.mark.parametrize("seed", SEEDS)
def test_ess_bounds_and_log_form(seed):
    g = torch.Generator().manual_seed(seed)
    logw = torch.randn(50, generator=g, dtype=torch.float64) * 2
    ess = effective_sample_size(logw.exp())
    assert 1.0 <= ess.item() <= 50.0
    assert effective_sample_size(logw, log_weights=True).item() == pytest.approx(ess.item())
    # the log form survives weights that overflow
    huge = torch.tensor([800.0, 799.0, 0.0], dtype=torch.float64)
    assert torch.isinf(huge.exp()).any()
    want = (math.exp(1) + 1) ** 2 / (math.exp(2) + 1)  # the third weight is negligible
    assert effective_sample_size(huge, log_weights=True).item() == pytest.approx(want)


def test_ess_falls_as_policies_drift():
    """The further pi_theta moves from pi_old, the fewer samples the weights are worth."""
    g = torch.Generator().manual_seed(0)
    old_logits = torch.randn(20)
    old = torch.softmax(old_logits, 0)
    x = torch.multinomial(old, 5000, replacement=True, generator=g)
    direction = torch.randn(20, generator=g)
    ess = []
    for step in [0.0, 0.5, 1.0, 2.0]:
        new = torch.log_softmax(old_logits + step * direction, 0)
        w = importance_weights(new[x][:, None], old.log()[x][:, None], torch.ones(5000, 1))
        ess.append(effective_sample_size(w).item())
    assert ess[0] == pytest.approx(5000)
    assert all(a > b for a, b in zip(ess, ess[1:]))
