import math

import pytest

from ppo_lab import AdaptiveKLController, FixedKLController, PPOPenaltyKLController


def test_fixed_never_moves():
    c = FixedKLController(0.05)
    for kl in [0.0, 1.0, 100.0]:
        assert c.update(kl, 64) == 0.05


@pytest.mark.parametrize("kl", [0.0, 3.0, 5.0, 5.5, 6.0, 7.0, 100.0])
@pytest.mark.parametrize("n_steps", [1, 64])
def test_adaptive_follows_the_ziegler_rule(kl, n_steps):
    c = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    error = min(max(kl / 6.0 - 1, -0.2), 0.2)
    assert c.update(kl, n_steps) == pytest.approx(0.2 * (1 + error * n_steps / 10000))


def test_adaptive_error_is_clipped_to_twenty_percent():
    c = AdaptiveKLController(1.0, target=1.0, horizon=1)
    assert c.update(1000.0, 1) == pytest.approx(1.2)
    assert c.update(0.0, 1) == pytest.approx(1.2 * 0.8)


def _simulate(controller, steps, kl_of_beta):
    kls = []
    for _ in range(steps):
        kl = kl_of_beta(controller.value)
        kls.append(kl)
        controller.update(kl, 1)
    return kls


def test_adaptive_holds_a_target():
    """A policy whose KL falls as beta rises (KL = 0.5 / beta): starting far from the target,
    the controller brings the KL to within 1% of it."""
    c = AdaptiveKLController(0.01, target=6.0, horizon=20)
    kls = _simulate(c, 600, lambda beta: 0.5 / beta)
    assert kls[0] == pytest.approx(50.0)
    assert abs(kls[-1] - 6.0) < 0.06
    assert c.value == pytest.approx(0.5 / 6.0, rel=0.01)


def test_ppo_penalty_rule():
    c = PPOPenaltyKLController(1.0, target=0.01)
    assert c.update(0.016) == 2.0  # above 1.5 x target: double
    assert c.update(0.015) == 2.0  # exactly 1.5 x target: unchanged
    assert c.update(0.012) == 2.0  # inside the band
    assert c.update(0.0067) == 2.0  # just above target / 1.5
    assert c.update(0.006) == 1.0  # below target / 1.5: halve
    # with KL = 0.02 / beta the rule settles beta into the band around the target
    kls = _simulate(c, 20, lambda beta: 0.02 / beta)
    assert 0.01 / 1.5 <= kls[-1] <= 0.015


@pytest.mark.parametrize(
    "make",
    [
        lambda: FixedKLController(0.1),
        lambda: AdaptiveKLController(0.1, 6.0, 100),
        lambda: PPOPenaltyKLController(0.1, 0.01),
    ],
)
def test_state_round_trip(make):
    a = make()
    for kl in [1.0, 0.001, 20.0]:
        a.update(kl, 8)
    b = make()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert b.update(3.0, 8) == a.update(3.0, 8)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: FixedKLController(-0.1), r"`kl_coef` must be in \[0, inf\]"),
        (lambda: AdaptiveKLController(0.1, 0.0, 100), r"`target` must be in \(0, inf\]"),
        (lambda: AdaptiveKLController(0.1, 6.0, 0), r"`horizon` must be in \(0, inf\]"),
        (lambda: PPOPenaltyKLController(0.1, -1), r"`target`"),
        (lambda: AdaptiveKLController(0.1, 6.0, 10).update(math.nan), r"`current_kl` must be"),
    ],
)
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()
