import pytest
import torch

import reference as ref
from conftest import DTYPES, SEEDS, SHAPES, random_mask, scribble
from ppo_lab import compute_gae, discounted_returns


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.9), (0.5, 0.0), (1.0, 1.0)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_reference(seed, shape, dtype, gamma, lam, holes):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    values = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    mask = random_mask(*shape, g, holes=holes)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = ref.gae(rewards, values, mask, gamma, lam)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(adv.double(), torch.tensor(want_adv, dtype=torch.float64), atol=tol, rtol=tol)
    torch.testing.assert_close(ret.double(), torch.tensor(want_ret, dtype=torch.float64), atol=tol, rtol=tol)
    assert adv.dtype == dtype


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("junk", [None, float("nan"), float("inf")])
def test_masked_positions_cannot_change_gae(seed, junk):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(5, 10, generator=g, dtype=torch.float64)
    values = torch.randn(5, 10, generator=g, dtype=torch.float64)
    mask = random_mask(5, 10, g, holes=seed == 2)
    clean = compute_gae(rewards, values, mask, 0.99, 0.95)
    dirty = compute_gae(scribble(rewards, mask, g, junk), scribble(values, mask, g, junk), mask, 0.99, 0.95)
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    assert torch.all(clean[0][mask == 0] == 0) and torch.all(clean[1][mask == 0] == 0)


def test_bootstraps_zero_after_the_last_real_token():
    """The value after the end is 0, even if the critic predicts something on padding."""
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.4, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = compute_gae(rewards, values, mask, 1.0, 0.0)
    assert adv[0, 1].item() == pytest.approx(1.0 - 0.4)  # delta = r + 0 - V
    assert adv[0, 0].item() == pytest.approx(0.0 + 0.4 - 0.5)


@pytest.mark.parametrize("seed", SEEDS)
def test_lambda_one_gamma_one_is_reward_to_go_minus_value(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(4, 8, generator=g, dtype=torch.float64)
    values = torch.randn(4, 8, generator=g, dtype=torch.float64)
    mask = random_mask(4, 8, g)
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, (discounted_returns(rewards, mask, 1.0) - values) * mask)
    torch.testing.assert_close(ret, discounted_returns(rewards, mask, 1.0))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [0.9, 1.0])
def test_lambda_zero_is_the_one_step_td_error(seed, gamma):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(4, 8, generator=g, dtype=torch.float64)
    values = torch.randn(4, 8, generator=g, dtype=torch.float64)
    mask = random_mask(4, 8, g)
    adv, _ = compute_gae(rewards, values, mask, gamma, 0.0)
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(4, 1, dtype=torch.float64)], 1)
    delta = (rewards + gamma * next_values - values) * mask
    torch.testing.assert_close(adv, delta)


def test_bandit_case_advantage_is_reward_minus_value():
    rewards = torch.tensor([[1.0], [0.0], [-2.0]])
    values = torch.tensor([[0.3], [0.1], [-1.0]])
    adv, ret = compute_gae(rewards, values, torch.ones(3, 1), 1.0, 1.0)
    torch.testing.assert_close(adv, rewards - values)
    torch.testing.assert_close(ret, rewards)


def test_returns_are_advantages_plus_values(gen):
    rewards = torch.randn(3, 6, generator=gen)
    values = torch.randn(3, 6, generator=gen)
    mask = random_mask(3, 6, gen)
    adv, ret = compute_gae(rewards, values, mask, 0.97, 0.9)
    torch.testing.assert_close(ret, (adv + values) * mask.float())
