import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as ref
from conftest import DTYPES, SEEDS, random_mask, scribble
from ppo_lab import AGGREGATION_MODES, aggregate_loss
from ppo_lab.aggregation import aggregation_count, micro_batch_weight


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("norm_length", [None, 32])
def test_modes_match_reference(seed, dtype, mode, norm_length):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(5, 9, generator=g, dtype=torch.float64).to(dtype)
    mask = random_mask(5, 9, g)
    got = aggregate_loss(loss, mask, mode, norm_length)
    want = ref.aggregate(ref.rows(loss), ref.rows(mask), mode, norm_length)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert got.item() == pytest.approx(want, rel=tol, abs=tol)
    assert aggregate_loss(scribble(loss, mask, g, float("nan")), mask, mode, norm_length).item() == got.item()


def test_modes_weigh_tokens_differently():
    """One short and one long response with the same per-token loss 1 on the long one."""
    loss = torch.tensor([[0.0, 0, 0, 0], [1.0, 1, 1, 1]])
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1]])
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(4 / 5)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(0.5)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(2.0)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(0.5)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", 8).item() == pytest.approx(0.25)


def test_unknown_mode_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'.*'token-mean'.*'seq-mean-token-sum-norm'"):
        aggregate_loss(torch.zeros(1, 2), torch.ones(1, 2), "mean")


# --- split invariance (chapter 10): the gradient of a minibatch does not depend on its split ----


@st.composite
def minibatch_and_split(draw):
    """A minibatch of B responses of random lengths, and a split of its rows into P processes x
    K micro-batches of equal size (as the trainer makes them), in a random order."""
    processes, micro, size = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    B, T = processes * micro * size, draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, T), min_size=B, max_size=B))
    order = draw(st.permutations(range(B)))
    seed = draw(st.integers(0, 2**16))
    return processes, micro, size, T, lengths, order, seed


def _weighted_gradient(losses_leaf, mask, mode, processes, micro, size, order, weigh):
    """The gradient DDP would apply: per process, the sum of its micro-batches' weighted
    aggregates, then the mean over processes."""
    grad = torch.zeros_like(losses_leaf)
    for p in range(processes):
        for j in range(micro):
            rows = torch.tensor(order[(p * micro + j) * size : (p * micro + j + 1) * size])
            part = aggregate_loss(losses_leaf[rows], mask[rows], mode) * weigh(mask[rows], processes, micro)
            (g,) = torch.autograd.grad(part, losses_leaf)
            grad += g / processes
    return grad


@settings(max_examples=150, deadline=None)
@given(case=minibatch_and_split(), mode=st.sampled_from(AGGREGATION_MODES))
def test_weighted_micro_batches_give_the_minibatch_gradient_for_any_split(case, mode):
    processes, micro, size, T, lengths, order, seed = case
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).double()
    losses = torch.randn(len(lengths), T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).requires_grad_()
    (whole,) = torch.autograd.grad(aggregate_loss(losses, mask, mode), losses)
    split = _weighted_gradient(losses, mask, mode, processes, micro, size, order, lambda m, P, K: micro_batch_weight(m, mask, mode, P))
    torch.testing.assert_close(split, whole)


def test_a_local_normaliser_gives_another_gradient_when_the_micro_batches_differ():
    """The mean of micro-batch means (each divided by the number of micro-batches) is what the
    weights replace: with a 4-token and a 1-token response in two micro-batches it gives the short
    response's token 1/2 of the loss instead of 1/5."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    losses = torch.randn(2, 4, dtype=torch.float64).requires_grad_()
    (whole,) = torch.autograd.grad(aggregate_loss(losses, mask, "token-mean"), losses)
    local = _weighted_gradient(losses, mask, "token-mean", 1, 2, 1, [0, 1], lambda m, P, K: 1.0 / K)
    weighted = _weighted_gradient(losses, mask, "token-mean", 1, 2, 1, [0, 1], lambda m, P, K: micro_batch_weight(m, mask, "token-mean", P))
    torch.testing.assert_close(weighted, whole)
    assert not torch.allclose(local, whole)
    assert local[1, 0].item() == pytest.approx(0.5) and whole[1, 0].item() == pytest.approx(0.2)
    assert float(aggregation_count(mask, "token-mean")) == 5.0 and float(aggregation_count(mask, "seq-mean-token-mean")) == 2.0


@settings(max_examples=60, deadline=None)
@given(case=minibatch_and_split())
def test_the_local_normaliser_fails_the_property_on_some_split(case):
    """Hypothesis finds splits where the local normaliser is wrong; here we only check that it is
    right exactly when every micro-batch holds the same number of tokens."""
    processes, micro, size, T, lengths, order, seed = case
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).double()
    losses = torch.randn(len(lengths), T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).requires_grad_()
    (whole,) = torch.autograd.grad(aggregate_loss(losses, mask, "token-mean"), losses)
    local = _weighted_gradient(losses, mask, "token-mean", processes, micro, size, order, lambda m, P, K: 1.0 / K)
    counts = {int(mask[torch.tensor(order[i * size : (i + 1) * size])].sum()) for i in range(processes * micro)}
    assert torch.allclose(local, whole) == (len(counts) == 1)
