import math

import pytest
import torch

import reference as ref
from conftest import SEEDS, random_mask, scribble
from ppo_lab import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    compute_gae,
    discounted_returns,
    get_advantage_estimator,
    register_advantage_estimator,
)


def _batch(seed, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = random_mask(B, T, g)
    return g, rewards, values, mask


def test_registry_holds_the_named_estimators():
    assert {"gae", "reinforce", "rloo", "grpo"} <= set(ADVANTAGE_ESTIMATORS)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*'gae'.*'grpo'.*'reinforce'.*'rloo'"):
        get_advantage_estimator("ppo")


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_entry_is_compute_gae(seed):
    _, rewards, values, mask = _batch(seed)
    got = compute_advantages("gae", rewards, mask, values=values, gamma=0.99, lam=0.9)
    want = compute_gae(rewards, values, mask, 0.99, 0.9)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="needs `values`"):
        compute_advantages("gae", rewards, mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_baselines(seed):
    _, rewards, values, mask = _batch(seed)
    G = discounted_returns(rewards, mask, 1.0)
    adv, ret = compute_advantages("reinforce", rewards, mask, values=values)
    torch.testing.assert_close(adv, (G - values) * mask)
    torch.testing.assert_close(ret, G)
    adv, _ = compute_advantages("reinforce", rewards, mask)
    mean_G = ref.mean(ref.real_values(G, mask))
    torch.testing.assert_close(adv, (G - mean_G) * mask)


def _group_reference(totals, groups, kind, norm_by_std=True, eps=1e-6):
    out = []
    for i, (r, gid) in enumerate(zip(totals, groups)):
        members = [j for j, h in enumerate(groups) if h == gid]
        if kind == "rloo":
            others = [totals[j] for j in members if j != i]
            out.append(r - sum(others) / len(others))
        else:
            vals = [totals[j] for j in members]
            mu = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
            out.append((r - mu) / (sd + eps) if norm_by_std else r - mu)
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind, norm", [("rloo", True), ("grpo", True), ("grpo", False)])
def test_group_estimators_match_loops(seed, kind, norm):
    g, rewards, _, mask = _batch(seed, B=9)
    groups = [3, 1, 3, 7, 1, 7, 3, 1, 7]  # uneven order, three groups of three
    options = {"norm_by_std": norm} if kind == "grpo" else {}   # only GRPO takes the switch
    adv, ret = compute_advantages(kind, rewards, mask, group_ids=torch.tensor(groups), **options)
    totals = [sum(v for v, m in zip(r, mr) if m) for r, mr in zip(ref.rows(rewards), ref.rows(mask))]
    want = _group_reference(totals, groups, kind, norm)
    for b in range(9):
        for t in range(5):
            assert adv[b, t].item() == pytest.approx(want[b] if mask[b, t] else 0.0, abs=1e-9)
            assert ret[b, t].item() == pytest.approx(totals[b] if mask[b, t] else 0.0, abs=1e-9)
    dirty = compute_advantages(kind, scribble(rewards, mask, g), mask, group_ids=groups, **options)
    assert torch.equal(dirty[0], adv)


def test_group_advantages_sum_to_zero_within_groups():
    """GRPO without the std and RLOO centre each group (RLOO scaled by n / (n - 1))."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(8, 1, generator=g, dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    for kind in ("rloo", "grpo"):
        adv, _ = compute_advantages(kind, rewards, torch.ones(8, 1), group_ids=groups)
        assert abs(adv[:4].sum().item()) < 1e-9 and abs(adv[4:].sum().item()) < 1e-9


def test_group_estimators_refuse_bad_groups():
    rewards, mask = torch.zeros(4, 2), torch.ones(4, 2)
    with pytest.raises(ValueError, match="need `group_ids`"):
        compute_advantages("grpo", rewards, mask)
    with pytest.raises(ValueError, match=r"at least 2 responses.*\[1, 3\]"):
        compute_advantages("rloo", rewards, mask, group_ids=[0, 0, 0, 1])
    with pytest.raises(ValueError, match=r"`group_ids` has shape \(3,\); expected \(4,\)"):
        compute_advantages("grpo", rewards, mask, group_ids=[0, 0, 1])


def test_custom_estimators_can_be_registered():
    @register_advantage_estimator("zero-test")
    def zero(rewards, mask, **_):
        return torch.zeros_like(rewards), torch.zeros_like(rewards)

    try:
        adv, _ = compute_advantages("zero-test", torch.ones(2, 2), torch.ones(2, 2))
        assert adv.sum() == 0
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("zero-test")(zero)
    finally:
        del ADVANTAGE_ESTIMATORS["zero-test"]


def test_a_misspelt_or_unknown_keyword_is_named_not_swallowed():
    rewards, mask = torch.randn(4, 3, dtype=torch.float64), torch.ones(4, 3)
    values = torch.randn(4, 3, dtype=torch.float64)
    # lamda=0.0 used to return the lam=1 result: every estimator accepts **_ for the common keywords
    with pytest.raises(TypeError, match=r"estimator 'gae' got an unknown keyword 'lamda'; did you mean 'lam'\?"):
        compute_advantages("gae", rewards, mask, values=values, lamda=0.0)
    with pytest.raises(TypeError, match=r"unknown keyword 'gama'; did you mean 'gamma'\?"):
        compute_advantages("gae", rewards, mask, values=values, gama=0.5)
    with pytest.raises(TypeError, match=r"estimator 'grpo' got an unknown keyword 'foo' \(it takes eps, gamma, group_ids, lam, norm_by_std, scores, values\)"):
        compute_advantages("grpo", rewards, mask, group_ids=[0, 0, 1, 1], foo=1)
    with pytest.raises(ValueError, match=r"`lam` must be in \[0, 1\], got 5.0"):
        compute_advantages("reinforce", rewards, mask, lam=5.0)
    with pytest.raises(ValueError, match=r"`gamma` must be in \[0, 1\], got -0.1"):
        compute_advantages("rloo", rewards, mask, group_ids=[0, 0, 1, 1], gamma=-0.1)
    # the spelled-out keyword still reaches the estimator: lam=0 is the one-step TD advantage
    adv, _ = compute_advantages("gae", rewards, mask, values=values, lam=0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros(4, 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(adv, rewards + next_values - values)


def test_group_ids_that_are_not_integers_are_named():
    rewards, mask = torch.randn(4, 2, dtype=torch.float64), torch.ones(4, 2)
    with pytest.raises(ValueError, match=r"`group_ids` must be integers, one per response \(str given\): number the prompts"):
        compute_advantages("grpo", rewards, mask, group_ids=["a", "a", "b", "b"])
    with pytest.raises(ValueError, match=r"`group_ids` must be integers, one per response \(a torch.float32 tensor given\)"):
        compute_advantages("rloo", rewards, mask, group_ids=torch.tensor([0.0, 0.0, 1.0, 1.0]))
    import numpy as np

    adv, _ = compute_advantages("rloo", rewards, mask, group_ids=np.array([0, 0, 1, 1]))   # numpy integers are integers
    torch.testing.assert_close(adv, compute_advantages("rloo", rewards, mask, group_ids=[0, 0, 1, 1])[0])
