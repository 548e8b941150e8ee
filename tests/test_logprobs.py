import pytest
import torch

import reference as ref
from conftest import DTYPES, SEEDS
from ppo_lab import entropy_from_logits, logprobs_from_logits


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
@pytest.mark.parametrize("shape", [(1, 1, 2), (3, 5, 11), (2, 9, 50)])
def test_logprobs_match_reference(seed, dtype, temperature, shape):
    g = torch.Generator().manual_seed(seed)
    B, T, V = shape
    logits = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    got = logprobs_from_logits(logits, tokens, temperature)
    want = torch.tensor(ref.logprobs(logits, tokens, temperature), dtype=torch.float64)
    assert got.shape == (B, T) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_matches_reference(seed, dtype, temperature):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 6, 17, generator=g, dtype=torch.float64) * 2).to(dtype)
    got = entropy_from_logits(logits, temperature)
    want = torch.tensor(ref.entropy(logits, temperature), dtype=torch.float64)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_docstring_examples():
    assert logprobs_from_logits(torch.zeros(1, 1, 2), torch.tensor([[1]])).item() == pytest.approx(
        -0.693147, abs=1e-6
    )
    assert entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(1.386294, abs=1e-6)


def test_bfloat16_is_computed_in_float32():
    """bf16 logits: the result is float32 and as exact as float32 math on the bf16 values,
    while a log-softmax done in bf16 itself is off by more than a typical PPO log-ratio."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 8, 1000, generator=g) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 1000, (2, 8), generator=g)
    got = logprobs_from_logits(logits, tokens)
    want = torch.tensor(ref.logprobs(logits, tokens), dtype=torch.float64)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-4
    naive = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert (naive.double() - want).abs().max() > 1e-3
    ent = entropy_from_logits(logits)
    assert ent.dtype == torch.float32
    torch.testing.assert_close(
        ent.double(), torch.tensor(ref.entropy(logits), dtype=torch.float64), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_gradient_matches_naive_log_softmax(temperature):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 4, 7, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 7, (2, 4), generator=g)
    weights = torch.randn(2, 4, generator=g, dtype=torch.float64)
    a = base.clone().requires_grad_()
    (logprobs_from_logits(a, tokens, temperature) * weights).sum().backward()
    b = base.clone().requires_grad_()
    naive = torch.log_softmax(b / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    (naive * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_entropy_ignores_tokens_removed_by_top_k():
    logits = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]])
    assert entropy_from_logits(logits).item() == pytest.approx(0.693147, abs=1e-6)


def test_temperature_changes_the_distribution_consistently():
    """Sampling at tau and scoring at tau agree: a cold softmax concentrates on the argmax."""
    logits = torch.tensor([[[2.0, 1.0, 0.0]]])
    top = torch.tensor([[0]])
    assert logprobs_from_logits(logits, top, 0.5) > logprobs_from_logits(logits, top, 1.0)
    assert entropy_from_logits(logits, 0.5) < entropy_from_logits(logits, 1.0)
