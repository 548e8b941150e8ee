"""Every public function refuses bad input with a ValueError that names what was wrong."""

import contextlib

import pytest
import torch

import ppo_lab as P
from ppo_lab._checks import skip_value_checks

z = torch.zeros(2, 3)
one = torch.ones(2, 3)
logits = torch.zeros(2, 3, 5)
tokens = torch.zeros(2, 3, dtype=torch.long)
ints = torch.tensor([[0, 0, 1], [1, 0, 1]])

CASES = [
    # shape mismatches
    ("gae shapes", lambda: P.compute_gae(z, torch.zeros(2, 4), one, 1.0, 0.9), r"`values` has shape \(2, 4\) but `rewards` has shape \(2, 3\)"),
    ("gae mask shape", lambda: P.compute_gae(z, z, torch.ones(3, 2), 1.0, 0.9), r"`mask` has shape \(3, 2\)"),
    ("logprobs shapes", lambda: P.logprobs_from_logits(logits, torch.zeros(2, 4, dtype=torch.long)), r"`logits` has shape \(2, 3, 5\) but `response_ids` has shape \(2, 4\)"),
    ("logprobs ndim", lambda: P.logprobs_from_logits(torch.zeros(3, 5), tokens), r"`logits` must have 3 dimension"),
    ("logprobs float tokens", lambda: P.logprobs_from_logits(logits, z), r"`response_ids` must hold integer ids"),
    ("full_kl shapes", lambda: P.full_kl(logits, torch.zeros(2, 3, 6)), r"`ref_logits` has shape"),
    ("kl shapes", lambda: P.kl_penalty(z, torch.zeros(2, 2)), r"`ref_logprobs` has shape"),
    ("policy loss shapes", lambda: P.clipped_policy_loss(z, z, torch.zeros(3), one, 0.2), r"`advantages` has shape \(3,\)"),
    ("value loss shapes", lambda: P.clipped_value_loss(z, z, torch.zeros(2, 1), one, 0.2), r"`returns` has shape"),
    ("scores shape", lambda: P.shape_rewards(torch.zeros(2, 1), z, z, one, 0.1), r"`scores` must have 1 dimension"),
    ("not a tensor", lambda: P.masked_mean([1.0, 2.0], one), r"`x` must be a torch.Tensor, got list"),
    # masks
    ("mask values", lambda: P.masked_mean(z, torch.full((2, 3), 0.5)), r"`mask` must contain only 0 and 1.*0.5"),
    ("mask values gae", lambda: P.compute_gae(z, z, one * 2, 1.0, 0.9), r"`mask` must contain only 0 and 1"),
    ("empty mask mean", lambda: P.masked_mean(z, torch.zeros(2, 3)), r"no real tokens \(all zeros\); cannot take a masked mean"),
    ("empty row mean", lambda: P.masked_mean(z, torch.tensor([[1.0, 0, 0], [0, 0, 0]]), dim=-1), r"no real tokens along dim=-1 at index\(es\) \[1\]"),
    ("empty mask whiten", lambda: P.masked_whiten(z, torch.zeros(2, 3)), r"no real tokens"),
    ("single token var", lambda: P.masked_var(z, torch.tensor([[1.0, 0, 0], [0, 0, 0]])), r"single real token"),
    ("empty mask loss", lambda: P.clipped_policy_loss(z, z, z, torch.zeros(2, 3), 0.2), r"no real tokens"),
    ("empty mask agg", lambda: P.aggregate_loss(z, torch.zeros(2, 3)), r"no real tokens"),
    # ranges
    ("negative gamma", lambda: P.compute_gae(z, z, one, -0.1, 0.9), r"`gamma` must be in \[0, 1\], got -0.1"),
    ("gamma above 1", lambda: P.discounted_returns(z, one, 1.5), r"`gamma` must be in \[0, 1\], got 1.5"),
    ("lam above 1", lambda: P.compute_gae(z, z, one, 1.0, 1.2), r"`lam` must be in \[0, 1\], got 1.2"),
    ("lam negative", lambda: P.compute_gae(z, z, one, 1.0, -0.5), r"`lam` must be in \[0, 1\]"),
    ("nan gamma", lambda: P.compute_gae(z, z, one, float("nan"), 0.9), r"`gamma` must be in \[0, 1\], got nan"),
    ("temperature zero", lambda: P.logprobs_from_logits(logits, tokens, 0.0), r"`temperature` must be in \(0, inf\], got 0.0"),
    ("entropy temperature", lambda: P.entropy_from_logits(logits, -1.0), r"`temperature` must be in \(0, inf\]"),
    ("clip eps", lambda: P.clipped_policy_loss(z, z, z, one, 0.0), r"`clip_eps` must be in \(0, inf\]"),
    ("clip eps high", lambda: P.clipped_policy_loss(z, z, z, one, 0.2, clip_eps_high=-1), r"`clip_eps_high`"),
    ("dual clip", lambda: P.clipped_policy_loss(z, z, z, one, 0.2, dual_clip=1.0), r"`dual_clip` must be in \(1, inf\]"),
    ("value clip", lambda: P.clipped_value_loss(z, z, z, one, -0.2), r"`value_clip` must be in \[0, inf\]"),
    ("kl coef", lambda: P.shape_rewards(torch.zeros(2), z, z, one, -0.1), r"`kl_coef` must be in \[0, inf\]"),
    ("score clip", lambda: P.shape_rewards(torch.zeros(2), z, z, one, 0.1, score_clip=0), r"`score_clip` must be in \(0, inf\]"),
    ("norm length", lambda: P.aggregate_loss(z, one, "seq-mean-token-sum-norm", 0), r"`norm_length` must be in \(0, inf\]"),
    # unknown names
    ("kl kind", lambda: P.kl_penalty(z, z, "k4"), r"unknown KL estimator 'k4'; valid values are: 'k1', 'k2', 'k3', 'abs'"),
    ("shaping kind", lambda: P.shape_rewards(torch.zeros(2), z, z, one, 0.1, kl_estimator="mse"), r"unknown KL estimator 'mse'"),
    ("agg mode", lambda: P.clipped_policy_loss(z, z, z, one, 0.2, loss_agg="sum"), r"unknown loss aggregation mode 'sum'"),
    ("is level", lambda: P.importance_weights(z, z, one, "batch"), r"unknown importance level 'batch'; valid values are: 'token', 'prefix', 'sequence'"),
    ("estimator", lambda: P.compute_advantages("ppo2", z, one), r"unknown advantage estimator 'ppo2'"),
    # weights
    ("negative weights", lambda: P.effective_sample_size(torch.tensor([1.0, -1.0])), r"`weights` must be non-negative"),
    ("zero weights", lambda: P.effective_sample_size(torch.zeros(3)), r"all zero"),
    ("empty weights", lambda: P.effective_sample_size(torch.zeros(0)), r"`weights` is empty"),
    # dtypes: integer values would be truncated silently (integer rewards give integer advantages)
    ("int rewards gae", lambda: P.compute_gae(ints, z, one, 1.0, 0.9), r"`rewards` must be a floating-point tensor \(float32, float64, \.\.\.\), got torch\.int64; convert it with \.float\(\)"),
    ("int values gae", lambda: P.compute_gae(z, ints, one, 1.0, 0.9), r"`values` must be a floating-point tensor .*got torch\.int64"),
    ("int rewards returns", lambda: P.discounted_returns(ints, one, 0.9), r"`rewards` must be a floating-point tensor .*got torch\.int64"),
    ("int rewards reinforce", lambda: P.compute_advantages("reinforce", ints, one), r"`rewards` must be a floating-point tensor .*got torch\.int64"),
    ("int values reinforce", lambda: P.compute_advantages("reinforce", z, one, values=ints), r"`values` must be a floating-point tensor"),
    ("int rewards rloo", lambda: P.compute_advantages("rloo", ints, one, group_ids=torch.zeros(2)), r"`rewards` must be a floating-point tensor"),
    ("bool x mean", lambda: P.masked_mean(one.bool(), one), r"`x` must be a floating-point tensor .*got torch\.bool"),
    ("int advantages loss", lambda: P.clipped_policy_loss(z, z, ints, one, 0.2), r"`advantages` must be a floating-point tensor"),
    ("int loss agg", lambda: P.aggregate_loss(ints, one), r"`loss` must be a floating-point tensor"),
    ("int ref logprobs kl", lambda: P.kl_penalty(z, ints), r"`ref_logprobs` must be a floating-point tensor"),
    ("int returns value loss", lambda: P.clipped_value_loss(z, z, ints, one, 0.2), r"`returns` must be a floating-point tensor"),
    ("int scores shaping", lambda: P.shape_rewards(torch.zeros(2, dtype=torch.long), z, z, one, 0.1), r"`scores` must be a floating-point tensor"),
    ("int logits", lambda: P.logprobs_from_logits(logits.long(), tokens), r"`logits` must be a floating-point tensor"),
]


@pytest.mark.parametrize("name, call, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_value_error(name, call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_integer_masks_are_still_accepted():
    # the dtype check is for values; a mask may be bool or integer (check_mask converts it)
    adv, _ = P.compute_gae(ints.float(), z, one.long(), 1.0, 0.95)
    torch.testing.assert_close(adv, P.compute_gae(ints.float(), z, one.bool(), 1.0, 0.95)[0])
    assert P.masked_mean(one, one.long()).item() == 1.0


# An empty response dimension (T = 0): the package's own error, whether or not the value
# checks run (without them it used to be a silent nan, an empty result or a torch error).
B0, E = 4, torch.zeros(4, 0)
EM, EL, ET = torch.ones(4, 0), torch.zeros(4, 0, 5), torch.zeros(4, 0, dtype=torch.long)
EMPTY_T = [
    ("compute_gae", lambda: P.compute_gae(E, E, EM, 1.0, 0.9)),
    ("discounted_returns", lambda: P.discounted_returns(E, EM, 1.0)),
    ("reinforce_loss", lambda: P.reinforce_loss(E, E, EM)),
    ("estimator gae", lambda: P.compute_advantages("gae", E, EM, values=E)),
    ("estimator reinforce", lambda: P.compute_advantages("reinforce", E, EM)),
    ("estimator rloo", lambda: P.compute_advantages("rloo", E, EM, group_ids=torch.zeros(B0))),
    ("estimator grpo", lambda: P.compute_advantages("grpo", E, EM, group_ids=torch.zeros(B0))),
    ("masked_mean", lambda: P.masked_mean(E, EM)),
    ("masked_mean dim", lambda: P.masked_mean(E, EM, dim=-1)),
    ("masked_var", lambda: P.masked_var(E, EM)),
    ("masked_whiten", lambda: P.masked_whiten(E, EM)),
    ("response_mask", lambda: P.response_mask(ET, 2)),
    ("aggregate_loss", lambda: P.aggregate_loss(E, EM, "seq-mean-token-sum")),
    ("clipped_policy_loss", lambda: P.clipped_policy_loss(E, E, E, EM, 0.2)),
    ("kl_penalized_policy_loss", lambda: P.kl_penalized_policy_loss(E, E, E, EM, 0.1)),
    ("clipped_value_loss", lambda: P.clipped_value_loss(E, E, E, EM, 0.2)),
    ("explained_variance", lambda: P.explained_variance(E, E, EM)),
    ("kl_penalty", lambda: P.kl_penalty(E, E)),
    ("full_kl", lambda: P.full_kl(EL, EL)),
    ("importance_weights", lambda: P.importance_weights(E, E, EM, "sequence")),
    ("shape_rewards", lambda: P.shape_rewards(torch.zeros(B0), E, E, EM, 0.1)),
    ("last_real_index", lambda: P.last_real_index(EM)),
    ("logprobs_from_logits", lambda: P.logprobs_from_logits(EL, ET)),
    ("entropy_from_logits", lambda: P.entropy_from_logits(EL)),
]


@pytest.mark.parametrize("value_checks", [True, False], ids=["checked", "skip_value_checks"])
@pytest.mark.parametrize("name, call", EMPTY_T, ids=[c[0] for c in EMPTY_T])
def test_empty_response_dimension_is_a_clear_value_error(name, call, value_checks):
    match = r"has an empty response dimension \(shape \(4, 0(, 5)?\)\); there must be at least one token"
    with contextlib.ExitStack() as stack:
        if not value_checks:
            stack.enter_context(skip_value_checks())
        with pytest.raises(ValueError, match=match):
            call()


def test_masked_whiten_float16_whitens_in_float32_when_the_variance_overflows():
    x = torch.linspace(-1000, 1000, 24).view(4, 6).half()  # variance ~3.6e5 > 65504
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    assert torch.isinf(P.masked_var(x.float(), mask).half())  # not representable in float16
    got = P.masked_whiten(x, mask)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, P.masked_whiten(x.float(), mask).half(), atol=1e-3, rtol=1e-3)
    assert got.abs().max() > 1.5  # not the all-zero result of an inf variance


def test_masked_mean_and_var_float16_do_not_overflow_in_their_sums():
    g = torch.Generator().manual_seed(0)
    x = (10 * torch.randn(10, 100, generator=g)).half()  # var ~100, but the sum of squares ~1e5
    big = torch.full((4, 100), 1000.0).half()  # mean 1000, but the sum 4e5
    mask = torch.ones(10, 100)
    var = P.masked_var(x, mask)
    assert var.dtype == torch.float16
    torch.testing.assert_close(var, P.masked_var(x.float(), mask).half(), atol=0, rtol=1e-3)
    mean = P.masked_mean(big, torch.ones(4, 100))
    assert mean.dtype == torch.float16 and mean.item() == 1000.0


def test_empty_slices_of_a_3d_mask_are_named_by_position():
    # the count along dim is 2-D here: name (i, j) pairs, not a flattened list of coordinates
    from ppo_lab._checks import check_nonempty_mask

    mask = torch.ones(2, 3, 4)
    mask[0, 2] = 0
    mask[1, 1] = 0
    with pytest.raises(ValueError, match=r"no real tokens along dim=-1 at index\(es\) \[\(0, 2\), \(1, 1\)\]; cannot take"):
        check_nonempty_mask(mask, "a mean", dim=-1)
