import pytest
import torch

import reference as ref
from conftest import DTYPES, SEEDS, random_mask, scribble
from ppo_lab import AGGREGATION_MODES, aggregate_loss


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
