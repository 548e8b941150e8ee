import math

import pytest
import torch

import reference as ref
from conftest import DTYPES, SEEDS, SHAPES, random_mask, scribble
from ppo_lab import masked_mean, masked_var, masked_whiten, response_mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("holes", [False, True])
def test_mean_and_var_match_reference(seed, shape, dtype, holes):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    mask = random_mask(*shape, g, holes=holes)
    vals = ref.real_values(x, mask)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    assert masked_mean(x, mask).item() == pytest.approx(ref.mean(vals), **{"abs": tol["atol"]})
    row_means = masked_mean(x, mask, dim=-1)
    for b in range(shape[0]):
        want = ref.mean(ref.real_values(x[b : b + 1], mask[b : b + 1]))
        assert row_means[b].item() == pytest.approx(want, abs=tol["atol"])
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(
        ref.var(vals, unbiased=False), abs=tol["atol"]
    )
    if len(vals) >= 2:
        assert masked_var(x, mask).item() == pytest.approx(ref.var(vals), abs=tol["atol"])


@pytest.mark.parametrize("junk", [float("nan"), float("inf"), -1e30])
def test_padding_content_never_changes_results(gen, junk):
    x = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    mask = random_mask(4, 9, gen)
    mask[0] = 1.0  # at least one full row, and at least two tokens overall
    dirty = scribble(x, mask, gen, value=junk)
    assert torch.equal(masked_mean(x, mask), masked_mean(dirty, mask))
    assert torch.equal(masked_mean(x, mask, dim=-1), masked_mean(dirty, mask, dim=-1))
    assert torch.equal(masked_var(x, mask), masked_var(dirty, mask))
    assert torch.equal(masked_whiten(x, mask), masked_whiten(dirty, mask))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_whitening_gives_mean_zero_std_one_over_the_mask(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(6, 12, generator=g, dtype=torch.float64) * 5 + 3).to(dtype)
    mask = random_mask(6, 12, g, holes=True)
    w = masked_whiten(x, mask)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    var_tol = 1e-5 if dtype == torch.float32 else 1e-8  # eps = 1e-8 in the denominator
    assert abs(masked_mean(w, mask).item()) < tol
    assert masked_var(w, mask).item() == pytest.approx(1.0, abs=var_tol)
    assert torch.all(w[mask == 0] == 0)
    # shift_mean=False: same scale, mean kept
    k = masked_whiten(x, mask, shift_mean=False)
    assert masked_mean(k, mask).item() == pytest.approx(masked_mean(x, mask).item(), abs=tol * 10)
    assert masked_var(k, mask).item() == pytest.approx(1.0, abs=var_tol)


def test_whitening_matches_formula(gen):
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = random_mask(3, 5, gen)
    mask[0] = 1
    vals = ref.real_values(x, mask)
    mu, sd = ref.mean(vals), math.sqrt(ref.var(vals) + 1e-8)
    w = masked_whiten(x, mask)
    for b in range(3):
        for t in range(5):
            want = (x[b, t].item() - mu) / sd if mask[b, t] else 0.0
            assert w[b, t].item() == pytest.approx(want, abs=1e-12)


def test_bool_and_int_masks_are_accepted(gen):
    x = torch.randn(2, 4, generator=gen)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert masked_mean(x, mask) == masked_mean(x, mask.bool()) == masked_mean(x, mask.float())


@pytest.mark.parametrize(
    "tokens, eos, want",
    [
        ([[5, 7, 2, 2, 2]], 2, [[1, 1, 1, 0, 0]]),  # pad == eos: the first 2 is real, the rest pad
        ([[2, 2, 2, 2]], 2, [[1, 0, 0, 0]]),  # the model stopped at once: one real token
        ([[5, 6, 7, 8]], 2, [[1, 1, 1, 1]]),  # no stop token: the whole budget is real
        ([[5, 9, 7, 8]], [2, 9], [[1, 1, 0, 0]]),  # several stop ids
        ([[5, 6, 7, 8]], None, [[1, 1, 1, 1]]),
        ([[5, 2, 0, 0], [2, 0, 0, 0]], 2, [[1, 1, 0, 0], [1, 0, 0, 0]]),  # pad 0 != eos 2
    ],
)
def test_response_mask(tokens, eos, want):
    assert response_mask(torch.tensor(tokens), eos).tolist() == want


def test_response_mask_with_pad_equal_eos_keeps_the_eos():
    """The trap: with pad == eos, `tokens != pad` drops the real EOS; response_mask does not."""
    eos = pad = 50256
    tokens = torch.tensor([[11, 12, eos, pad, pad], [21, 22, 23, 24, 25]])
    naive = (tokens != pad).float()
    mask = response_mask(tokens, eos)
    assert naive[0].sum() == 2 and mask[0].sum() == 3
    assert mask[1].sum() == 5
