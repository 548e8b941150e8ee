"""Every public function refuses bad input with a ValueError that names what was wrong."""

import pytest
import torch

import ppo_lab as P

z = torch.zeros(2, 3)
one = torch.ones(2, 3)
logits = torch.zeros(2, 3, 5)
tokens = torch.zeros(2, 3, dtype=torch.long)

CASES = [
    # shape mismatches
    ("gae shapes", lambda: P.compute_gae(z, torch.zeros(2, 4), one, 1.0, 0.9), r"`values` has shape \(2, 4\) but `rewards` has shape \(2, 3\)"),
    ("gae mask shape", lambda: P.compute_gae(z, z, torch.ones(3, 2), 1.0, 0.9), r"`mask` has shape \(3, 2\)"),
    ("logprobs shapes", lambda: P.logprobs_from_logits(logits, torch.zeros(2, 4, dtype=torch.long)), r"`logits` has shape \(2, 3, 5\) but `tokens` has shape \(2, 4\)"),
    ("logprobs ndim", lambda: P.logprobs_from_logits(torch.zeros(3, 5), tokens), r"`logits` must have 3 dimension"),
    ("logprobs float tokens", lambda: P.logprobs_from_logits(logits, z), r"`tokens` must hold integer ids"),
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
    ("value clip", lambda: P.clipped_value_loss(z, z, z, one, -0.2), r"`clip_range` must be in \[0, inf\]"),
    ("kl coef", lambda: P.shape_rewards(torch.zeros(2), z, z, one, -0.1), r"`kl_coef` must be in \[0, inf\]"),
    ("score clip", lambda: P.shape_rewards(torch.zeros(2), z, z, one, 0.1, score_clip=0), r"`score_clip` must be in \(0, inf\]"),
    ("norm length", lambda: P.aggregate_loss(z, one, "seq-mean-token-sum-norm", 0), r"`norm_length` must be in \(0, inf\]"),
    # unknown names
    ("kl kind", lambda: P.kl_penalty(z, z, "k4"), r"unknown KL estimator 'k4'; valid values are: 'k1', 'k2', 'k3', 'abs'"),
    ("shaping kind", lambda: P.shape_rewards(torch.zeros(2), z, z, one, 0.1, kind="mse"), r"unknown KL estimator 'mse'"),
    ("agg mode", lambda: P.clipped_policy_loss(z, z, z, one, 0.2, agg="sum"), r"unknown loss aggregation mode 'sum'"),
    ("is level", lambda: P.importance_weights(z, z, one, "batch"), r"unknown importance level 'batch'; valid values are: 'token', 'sequence'"),
    ("estimator", lambda: P.compute_advantages("ppo2", z, one), r"unknown advantage estimator 'ppo2'"),
    # weights
    ("negative weights", lambda: P.effective_sample_size(torch.tensor([1.0, -1.0])), r"`weights` must be non-negative"),
    ("zero weights", lambda: P.effective_sample_size(torch.zeros(3)), r"all zero"),
    ("empty weights", lambda: P.effective_sample_size(torch.zeros(0)), r"`weights` is empty"),
]


@pytest.mark.parametrize("name, call, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_value_error(name, call, match):
    with pytest.raises(ValueError, match=match):
        call()
