import pytest
import torch

import reference as ref
from conftest import DTYPES, SEEDS, SHAPES, random_mask, scribble
from ppo_lab import discounted_returns, reinforce_loss


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma", [0.0, 0.9, 1.0])
@pytest.mark.parametrize("holes", [False, True])
def test_reward_to_go_matches_double_sum(seed, shape, dtype, gamma, holes):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    mask = random_mask(*shape, g, holes=holes)
    got = discounted_returns(rewards, mask, gamma)
    want = torch.tensor(ref.reward_to_go(rewards, mask, gamma), dtype=torch.float64)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    dirty = scribble(rewards, mask, g)
    assert torch.equal(discounted_returns(dirty, mask, gamma), got)


def test_reward_to_go_docstring_example():
    got = discounted_returns(torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3), 0.5)
    assert got.tolist() == [[0.25, 0.5, 1.0]]


def test_reinforce_gradient_is_the_policy_gradient_sum(gen):
    """d loss / d logprobs[b, t] = -weights[b, t] * mask[b, t] / B (seq-mean-token-sum)."""
    logprobs = torch.randn(4, 6, generator=gen, dtype=torch.float64).requires_grad_()
    weights = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = random_mask(4, 6, gen)
    reinforce_loss(logprobs, weights, mask).backward()
    torch.testing.assert_close(logprobs.grad, -weights * mask / 4)


def test_reinforce_weights_are_constants(gen):
    logprobs = torch.randn(2, 3, generator=gen).requires_grad_()
    weights = torch.randn(2, 3, generator=gen).requires_grad_()
    reinforce_loss(logprobs, weights, torch.ones(2, 3)).backward()
    assert weights.grad is None


@pytest.mark.parametrize("baseline", [0.0, 0.6])
def test_reinforce_on_a_bandit_is_unbiased(baseline):
    """One-token bandit with a softmax policy: the exact gradient of J = sum_a pi_a R_a is
    pi_k (R_k - J); the mean REINFORCE estimate must match it (with or without a baseline)."""
    g = torch.Generator().manual_seed(0)
    theta = torch.tensor([0.5, -0.3, 0.1, 0.0], dtype=torch.float64, requires_grad=True)
    R = torch.tensor([1.0, 0.0, 0.3, 0.7], dtype=torch.float64)
    pi = torch.softmax(theta, 0).detach()
    exact = pi * (R - (pi * R).sum())
    n = 40000
    actions = torch.multinomial(pi, n, replacement=True, generator=g)
    logprobs = torch.log_softmax(theta, 0)[actions][:, None]  # (N, 1): one token per episode
    weights = (R[actions] - baseline)[:, None]
    reinforce_loss(logprobs, weights, torch.ones(n, 1)).backward()
    estimate = -theta.grad
    # per-sample gradient std is below 1 here, so 5 standard errors is under 0.025
    assert torch.allclose(estimate, exact, atol=5 / n**0.5)
