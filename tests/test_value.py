import pytest
import torch

import reference as ref
from conftest import DTYPES, SEEDS, random_mask, scribble
from ppo_lab import clipped_value_loss, explained_variance


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value_clip", [None, 0.0, 0.2, 10.0])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_reference(seed, dtype, value_clip, agg):
    g = torch.Generator().manual_seed(seed)
    shape = (4, 6)
    values = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    old = (values.double() + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    returns = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    mask = random_mask(*shape, g)
    loss, metrics = clipped_value_loss(values, old, returns, mask, value_clip, agg)
    per_token, clipped_more = [], []
    for v_row, o_row, r_row in zip(ref.rows(values), ref.rows(old), ref.rows(returns)):
        pt, cm = [], []
        for v, o, r in zip(v_row, o_row, r_row):
            if value_clip is None:
                pt.append((v - r) ** 2)
                cm.append(0.0)
            else:
                vc = o + min(max(v - o, -value_clip), value_clip)
                pt.append(max((v - r) ** 2, (vc - r) ** 2))
                cm.append(1.0 if (vc - r) ** 2 > (v - r) ** 2 else 0.0)
        per_token.append(pt)
        clipped_more.append(cm)
    m = ref.rows(mask)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert loss.item() == pytest.approx(0.5 * ref.aggregate(per_token, m, agg), rel=tol, abs=tol)
    assert metrics["value/clipfrac"].item() == pytest.approx(ref.aggregate(clipped_more, m, "token-mean"), abs=1e-7)
    if value_clip == 10.0:  # nothing is far enough to be clipped
        assert metrics["value/clipfrac"].item() == 0.0


def test_value_clipping_cuts_the_gradient_only_where_the_clipped_error_is_larger():
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, -1.0, 0.05]])
    values = torch.tensor([[0.5, -0.5, 0.5, 0.1]], requires_grad=True)
    loss, m = clipped_value_loss(values, old, returns, torch.ones(1, 4), value_clip=0.2)
    loss.backward()
    grad = values.grad[0]
    # token 0: moved 0.5 toward the target; clipped error (0.8^2) is larger -> no gradient
    assert grad[0] == 0
    # token 1: moved away from the target; unclipped error is larger -> gradient flows
    assert grad[1] == pytest.approx(2 * 0.5 * (-0.5 - 1.0) / 4)
    # token 2: moved away (0.5 vs target -1); unclipped larger -> gradient
    assert grad[2] != 0
    # token 3: inside the clip range -> ordinary gradient
    assert grad[3] == pytest.approx((0.1 - 0.05) / 4)
    assert m["value/clipfrac"].item() == pytest.approx(0.25)


def test_explained_variance():
    g = torch.Generator().manual_seed(0)
    returns = torch.randn(4, 5, generator=g)
    mask = random_mask(4, 5, g)
    mask[0] = 1
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    constant = torch.full_like(returns, 7.0)
    assert explained_variance(constant, returns, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert explained_variance(-returns, returns, mask).item() < 0
    dirty = scribble(returns, mask, g)
    assert explained_variance(returns, dirty, mask).item() == pytest.approx(1.0)
    assert torch.isnan(explained_variance(returns, torch.ones(4, 5), torch.ones(4, 5)))
