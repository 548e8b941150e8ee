import math

import pytest
import torch

import reference as ref
from conftest import DTYPES, SEEDS
from ppo_lab import KL_ESTIMATORS, full_kl, kl_penalty


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KL_ESTIMATORS)
def test_estimators_match_formulas(seed, dtype, kind):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(3, 9, generator=g, dtype=torch.float64) - 2).to(dtype)
    rlp = (torch.randn(3, 9, generator=g, dtype=torch.float64) - 2).to(dtype)
    got = kl_penalty(lp, rlp, kind)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for b, (l_row, r_row) in enumerate(zip(ref.rows(lp), ref.rows(rlp))):
        for t, (a, r) in enumerate(zip(l_row, r_row)):
            assert got[b, t].item() == pytest.approx(ref.kl_estimate(a, r, kind), rel=tol, abs=tol)


def test_k3_never_negative_and_stable_near_zero():
    g = torch.Generator().manual_seed(0)
    for scale in [1e-8, 1e-4, 1e-2, 1.0, 10.0]:
        lp = torch.randn(1000, generator=g) * scale
        rlp = torch.randn(1000, generator=g) * scale
        assert (kl_penalty(lp[None], rlp[None], "k3") >= 0).all()
    # float32, log r = 1e-4: the true value is ~5.0e-9; exp(x) - 1 - x gives ~1.7e-8.
    x = torch.tensor([[1e-4]])
    got = kl_penalty(torch.zeros(1, 1), x, "k3").item()
    assert got == pytest.approx(math.expm1(1e-4) - 1e-4, rel=1e-3)
    naive = (torch.exp(x) - 1 - x).item()
    assert abs(naive - 5e-9) > 1e-9


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_full_kl_matches_reference(seed, dtype, temperature):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(2, 5, 13, generator=g, dtype=torch.float64) * 2).to(dtype)
    b = (torch.randn(2, 5, 13, generator=g, dtype=torch.float64) * 2).to(dtype)
    got = full_kl(a, b, temperature)
    want = torch.tensor(ref.kl_exact(a, b, temperature), dtype=torch.float64)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert (got >= -tol).all()
    assert torch.allclose(full_kl(a, a, temperature), torch.zeros(2, 5, dtype=dtype), atol=tol)


def test_full_kl_in_bfloat16_is_accurate():
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(2, 4, 500, generator=g) * 3).to(torch.bfloat16)
    b = (torch.randn(2, 4, 500, generator=g) * 3).to(torch.bfloat16)
    got = full_kl(a, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.tensor(ref.kl_exact(a, b), dtype=torch.float64), atol=1e-4, rtol=1e-5)


def _monte_carlo(p_logits, q_logits, n, seed):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(p_logits.double(), -1)
    logq = torch.log_softmax(q_logits.double(), -1)
    x = torch.multinomial(logp.exp(), n, replacement=True, generator=g)
    truth = full_kl(p_logits.double()[None, None], q_logits.double()[None, None]).item()
    samples = {k: kl_penalty(logp[x][None], logq[x][None], k)[0] for k in KL_ESTIMATORS}
    return truth, samples


@pytest.mark.parametrize("seed", SEEDS)
def test_k1_and_k3_are_unbiased_k2_is_not(seed):
    """Monte Carlo with n = 200k samples from pi: |mean - KL| < 5 standard errors for k1 and k3;
    for distributions far apart, k2's mean misses KL by far more than that."""
    n = 200_000
    p = torch.tensor([2.0, 0.5, -1.0, 0.0, 1.0, -2.0])
    q = torch.tensor([-1.0, 1.5, 0.5, 0.0, -0.5, 1.0])
    truth, s = _monte_carlo(p, q, n, seed)
    for kind in ("k1", "k3"):
        se = s[kind].std().item() / math.sqrt(n)
        assert abs(s[kind].mean().item() - truth) < 5 * se, kind
    se2 = s["k2"].std().item() / math.sqrt(n)
    assert abs(s["k2"].mean().item() - truth) > 20 * se2


def test_k3_has_lower_variance_than_k1_when_close():
    p = torch.tensor([1.0, 0.5, -1.0, 0.0, 0.3])
    q = p + torch.tensor([0.1, -0.1, 0.05, 0.0, -0.05])
    _, s = _monte_carlo(p, q, 50_000, 0)
    assert s["k3"].var() < 0.1 * s["k1"].var()
    assert (s["k1"] < 0).any() and (s["k3"] >= 0).all()
