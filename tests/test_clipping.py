import math

import pytest
import torch

import reference as ref
from conftest import DTYPES, SEEDS, random_mask, scribble
from ppo_lab import AGGREGATION_MODES, clipped_policy_loss


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps_high", [None, 0.28])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("agg", AGGREGATION_MODES)
def test_loss_and_metrics_match_reference(seed, dtype, eps_high, dual_clip, agg):
    g = torch.Generator().manual_seed(seed)
    shape = (5, 8)
    old = (torch.randn(shape, generator=g, dtype=torch.float64) - 1).to(dtype)
    lp = (old.double() + torch.randn(shape, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    adv = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    mask = random_mask(*shape, g)
    loss, metrics = clipped_policy_loss(lp, old, adv, mask, 0.2, eps_high, dual_clip, agg)
    hi = 0.2 if eps_high is None else eps_high
    per_token, clipped, k3, ratios = [], [], [], []
    for l_row, o_row, a_row, m_row in zip(ref.rows(lp), ref.rows(old), ref.rows(adv), ref.rows(mask)):
        per_token.append([ref.policy_loss_per_token(l, o, a, 0.2, hi, dual_clip) for l, o, a in zip(l_row, o_row, a_row)])
        c_row = []
        for l, o, a, m in zip(l_row, o_row, a_row, m_row):
            r = math.exp(l - o)
            c_row.append(1.0 if -a * min(max(r, 0.8), 1 + hi) > -a * r else 0.0)
            if m:
                k3.append(r - 1 - math.log(r))
                ratios.append(r)
        clipped.append(c_row)
    m = ref.rows(mask)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert loss.item() == pytest.approx(ref.aggregate(per_token, m, agg), rel=tol, abs=tol)
    assert metrics["policy/clipfrac"].item() == pytest.approx(ref.aggregate(clipped, m, "token-mean"), abs=1e-7)
    assert metrics["policy/approx_kl"].item() == pytest.approx(ref.mean(k3), rel=tol, abs=tol)
    assert metrics["policy/ratio_mean"].item() == pytest.approx(ref.mean(ratios), rel=tol)
    assert metrics["policy/ratio_max"].item() == pytest.approx(max(ratios), rel=tol)
    assert metrics["policy/ratio_min"].item() == pytest.approx(min(ratios), rel=tol)
    assert ("policy/dual_clipfrac" in metrics) == (dual_clip is not None)
    dirty = clipped_policy_loss(scribble(lp, mask, g), old, scribble(adv, mask, g), mask, 0.2, eps_high, dual_clip, agg)
    assert dirty[0].item() == loss.item()


# The six cases of the clipped objective (PPO paper, figure 1; the DeepSpeed-Chat explainer's
# table): sign of A x where the ratio sits. Gradient is zero exactly in two of them.
SIX_CASES = [
    # (advantage, ratio, gradient should be zero)
    (1.0, 0.7, False),  # A > 0, ratio below the range: push it up, gradient flows
    (1.0, 1.05, False),  # A > 0, inside the range
    (1.0, 1.4, True),  # A > 0, above 1 + eps: already improved enough, clipped
    (-1.0, 0.7, True),  # A < 0, below 1 - eps: already reduced enough, clipped
    (-1.0, 0.95, False),  # A < 0, inside the range
    (-1.0, 1.4, False),  # A < 0, above the range: it got worse, gradient pulls it back
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("adv, ratio, zero", SIX_CASES)
def test_gradient_is_zero_exactly_in_the_clipped_cases(dtype, adv, ratio, zero):
    old = torch.tensor([[-1.0]], dtype=dtype)
    lp = (old + math.log(ratio)).requires_grad_()
    loss, metrics = clipped_policy_loss(lp, old, torch.tensor([[adv]], dtype=dtype), torch.ones(1, 1), 0.2)
    loss.backward()
    if zero:
        assert lp.grad.item() == 0.0
        assert metrics["policy/clipfrac"].item() == 1.0
    else:
        # d(-A * rho)/d logp = -A * rho
        assert lp.grad.item() == pytest.approx(-adv * ratio, rel=1e-6)
        assert metrics["policy/clipfrac"].item() == 0.0


def test_asymmetric_range_moves_only_the_upper_bound():
    old = torch.zeros(1, 2)
    lp = torch.log(torch.tensor([[1.25, 0.75]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0]])
    _, sym = clipped_policy_loss(lp, old, adv, torch.ones(1, 2), 0.2)
    _, asym = clipped_policy_loss(lp, old, adv, torch.ones(1, 2), 0.2, clip_eps_high=0.28)
    assert sym["policy/clipfrac"].item() == 1.0  # 1.25 > 1.2 and 0.75 < 0.8
    assert asym["policy/clipfrac"].item() == 0.5  # 1.25 < 1.28 now passes; 0.75 still clipped


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    g = torch.Generator().manual_seed(0)
    old = torch.zeros(1, 200)
    lp = (torch.randn(1, 200, generator=g) * 3).requires_grad_()  # ratios up to e^9
    adv = -torch.rand(1, 200, generator=g) - 0.1
    loss_tokens = []
    for t in range(200):
        loss, _ = clipped_policy_loss(lp[:, t : t + 1], old[:, t : t + 1], adv[:, t : t + 1], torch.ones(1, 1), 0.2, dual_clip=3.0)
        loss_tokens.append(loss.item())
        assert loss.item() <= -3.0 * adv[0, t].item() + 1e-6
    # without dual clip the worst token's loss is far above that bound
    worst = int(torch.argmax(lp.detach()))
    plain, _ = clipped_policy_loss(lp[:, worst : worst + 1], old[:, :1], adv[:, worst : worst + 1], torch.ones(1, 1), 0.2)
    assert plain.item() > -3.0 * adv[0, worst].item()
    # and where the cap is active the gradient is zero
    big = torch.tensor([[math.log(10.0)]], requires_grad=True)
    loss, m = clipped_policy_loss(big, torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1), 0.2, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(3.0) and big.grad.item() == 0.0
    assert m["policy/dual_clipfrac"].item() == 1.0


def test_positive_advantages_are_untouched_by_dual_clip(gen):
    old = torch.zeros(2, 5)
    lp = torch.randn(2, 5, generator=gen)
    adv = torch.rand(2, 5, generator=gen) + 0.1
    a, _ = clipped_policy_loss(lp, old, adv, torch.ones(2, 5), 0.2)
    b, _ = clipped_policy_loss(lp, old, adv, torch.ones(2, 5), 0.2, dual_clip=3.0)
    assert a.item() == b.item()


def test_on_policy_first_step_is_the_policy_gradient(gen):
    """At ratio = 1 the clipped loss has the gradient of -A * log pi (no clipping yet)."""
    old = torch.randn(3, 4, generator=gen)
    adv = torch.randn(3, 4, generator=gen)
    lp = old.clone().requires_grad_()
    loss, metrics = clipped_policy_loss(lp, old, adv, torch.ones(3, 4), 0.2)
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv / 12)
    assert metrics["policy/approx_kl"].item() == 0.0 and metrics["policy/clipfrac"].item() == 0.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.0, 0.5, 3.0])
def test_kl_penalized_loss_matches_reference(seed, beta):
    from ppo_lab import kl_penalized_policy_loss

    g = torch.Generator().manual_seed(seed)
    old = torch.randn(4, 6, generator=g, dtype=torch.float64) - 1
    lp = (old + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.4).requires_grad_()
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = random_mask(4, 6, g)
    loss, metrics = kl_penalized_policy_loss(lp, old, adv, mask, beta)
    per_token = []
    for l_row, o_row, a_row in zip(ref.rows(lp.detach()), ref.rows(old), ref.rows(adv)):
        per_token.append([-a * math.exp(l - o) + beta * (math.exp(l - o) - 1 - (l - o)) for l, o, a in zip(l_row, o_row, a_row)])
    assert loss.item() == pytest.approx(ref.aggregate(per_token, ref.rows(mask), "token-mean"), rel=1e-12)
    assert metrics["policy/clipfrac"].item() == 0.0
    # no token's gradient is cut: every real token with A != 0 or rho != 1 keeps a gradient
    loss.backward()
    assert (lp.grad[mask.bool()] != 0).all()
    # at rho = 1 the penalty's gradient vanishes: the first step is the plain policy gradient
    same = old.clone().requires_grad_()
    kl_penalized_policy_loss(same, old, adv, torch.ones_like(adv), beta)[0].backward()
    torch.testing.assert_close(same.grad, -adv / adv.numel())
