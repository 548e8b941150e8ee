"""The objects the trainer's loop calls on every run, whatever the configuration.

Each variant of chapters 8-10 and Appendix A reaches the loop as an object: off, it must do
exactly what the plain loop did (checked end to end by the trainer's tests, metric for metric);
these check each object's own contract.
"""

import dataclasses

import pytest
import torch

from conftest import random_mask
from ppo_lab.batch import PER_RESPONSE, TEXT, Rollout, cat_rollouts, padding
from ppo_lab.disagreements import Choices, gae_over_padding, score_past_last, whiten_with_padding
from ppo_lab.dynamic_sampling import DynamicSampling, OneRollout, collector
from ppo_lab.masked import masked_whiten
from ppo_lab.models import PolicyWithValueHead
from ppo_lab.rewards import GoldReward
from ppo_lab.sampler import Sampler, old_logprobs_source


def test_every_rollout_field_has_a_padding_rule():
    pad = 7
    for field in dataclasses.fields(Rollout):
        rule = padding(field.name, pad)
        if field.name in PER_RESPONSE or field.name in TEXT:
            assert rule is None, field.name
        else:
            fill, front = rule
            assert front == field.name.startswith("query_"), field.name  # prompts are left-padded
            assert fill == (pad if field.name.endswith("_ids") else 0), field.name


def _rollout(B, T, P, gen, pad=9):
    mask = random_mask(B, T, gen).float()
    t = lambda: torch.randn(B, T, generator=gen) * mask  # noqa: E731
    return Rollout(
        prompts=[f"p{i}" for i in range(B)], responses=[f"r{i}" for i in range(B)], query_ids=torch.randint(0, 5, (B, P), generator=gen),
        query_mask=torch.ones(B, P), response_ids=torch.where(mask.bool(), torch.randint(0, 5, (B, T), generator=gen), torch.full((B, T), pad)),
        mask=mask, old_logprobs=t(), ref_logprobs=t(), values=None, entropy=t(), scores=torch.randn(B, generator=gen),
        ended=torch.rand(B, generator=gen) < 0.5, group_ids=torch.arange(B) // 2,
    )


def test_cat_rollouts_pads_by_the_rule_and_keeps_every_row(gen):
    a, b = _rollout(4, 3, 2, gen), _rollout(2, 5, 4, gen)
    out = cat_rollouts([(a, torch.tensor([0, 1, 3])), (b, torch.tensor([1]))], pad_id=9)
    assert out.response_ids.shape == (4, 5) and out.query_ids.shape == (4, 4)
    assert torch.equal(out.query_ids[:3, 2:], a.query_ids[[0, 1, 3]]) and (out.query_ids[:3, :2] == 9).all()  # at the front
    assert torch.equal(out.response_ids[:3, :3], a.response_ids[[0, 1, 3]]) and (out.response_ids[:3, 3:] == 9).all()  # at the back
    assert (out.query_mask[:3, :2] == 0).all() and (out.query_mask[:3, 2:] == 1).all()
    assert (out.mask[:3, 3:] == 0).all() and out.values is None
    assert out.prompts == ["p0", "p1", "p3", "p1"] and out.group_ids.tolist() == [0, 0, 1, 2]  # groups kept apart


def test_choices_are_ppo_labs_own_unless_named(gen):
    B, T = 4, 6
    mask = random_mask(B, T, gen)
    rewards, values, adv = (torch.randn(B, T, generator=gen, dtype=torch.float64) for _ in range(3))
    scores = torch.randn(B, generator=gen, dtype=torch.float64)
    ours = Choices()
    assert ours.score_temperature(0.7) == 0.7 and ours.place_score(rewards, scores, mask) is rewards
    estimator = lambda *a, **k: "ours"  # noqa: E731
    assert ours.estimator(estimator) is estimator
    torch.testing.assert_close(ours.whiten(adv, mask), masked_whiten(adv, mask))
    other = Choices.parse("score-past-last, gae-over-padding,whiten-with-padding,temperature-1-in-scoring")
    assert other.score_temperature(0.7) == 1.0
    torch.testing.assert_close(other.place_score(rewards, scores, mask), score_past_last(rewards, scores, mask))
    torch.testing.assert_close(other.whiten(adv, mask), whiten_with_padding(adv, mask))
    got = other.estimator(estimator)(rewards, mask, values=values, gamma=1.0, lam=0.9, group_ids=None)
    want = gae_over_padding(rewards, values, mask, 1.0, 0.9)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="not one of"):
        Choices.parse("score-past-first")


@pytest.mark.parametrize("old_logprobs_from", ["auto", "sampling", "forward"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("differs", [False, True])
@pytest.mark.parametrize("correction", ["none", "tis"])
def test_auto_takes_pi_old_from_sampling_only_when_the_sampler_is_the_fp32_trainer(old_logprobs_from, precision, differs, correction):
    source = old_logprobs_source(old_logprobs_from, precision, differs, correction)
    if old_logprobs_from != "auto":
        assert source == old_logprobs_from
    else:
        assert source == ("sampling" if precision == "fp32" and not differs and correction == "none" else "forward")


def test_the_sampler_adds_nothing_when_it_is_the_trainer(gen):
    lm = torch.nn.Linear(2, 2)
    plain = Sampler(lm, seed=0)
    assert plain.copy is None and plain.model(lm, 3) is lm and not plain.differs and plain.from_sampling
    mask = random_mask(3, 4, gen)
    lp = torch.randn(3, 4, generator=gen)
    assert plain.weights(lp, lp, mask) is None and plain.metrics(lp, lp, mask, None) == {}
    shared = PolicyWithValueHead.__new__(PolicyWithValueHead)  # (a shared critic's policy; no LM needed here)
    torch.nn.Module.__init__(shared)
    shared.v_head = torch.nn.Linear(2, 1)
    assert plain.value_head(shared) is shared.v_head
    assert plain.value_head(type("P", (), {"v_head": "head"})()) is None  # only a PolicyWithValueHead's head
    noisy = Sampler(lm, seed=0, noise=0.1, correction="tis")
    assert noisy.differs and noisy.old_logprobs_from == "forward" and noisy.value_head(shared) is None
    torch.testing.assert_close(noisy.weights(lp, lp, mask), mask.float())  # no gap: weight 1 on every real token
    metrics = noisy.metrics(lp, lp, mask, noisy.weights(lp, lp, mask))
    assert set(metrics) == {"sampler/kl", "sampler/ess", "sampler/corrected_frac"} and float(metrics["sampler/kl"]) == 0.0


def test_one_rollout_and_dynamic_sampling_collect_through_the_same_call(gen):
    assert isinstance(collector(False, 2, 4, 3), OneRollout) and isinstance(collector(True, 2, 4, 3), DynamicSampling)
    prompts = iter([["a", "b"], ["c", "d"], ["e", "f"]])
    calls = []

    def rollout(ps, attempt):
        calls.append((ps, attempt))
        ro = _rollout(4, 3, 2, gen)
        ro.scores = torch.tensor([1.0, 1.0, 0.0, 1.0]) if attempt == 0 else torch.tensor([0.0, 1.0, 2.0, 2.0])
        return ro

    ro, metrics = OneRollout().collect(rollout, lambda: next(prompts), 9)
    assert len(ro) == 4 and metrics == {} and calls == [(["a", "b"], 0)]
    ro, metrics = DynamicSampling(group_size=2, groups=2, max_rounds=3).collect(rollout, lambda: next(prompts), 9)
    assert len(ro) == 4 and [c[1] for c in calls[1:]] == [0, 1]  # the first round had one informative group of two
    assert metrics["dynamic_sampling/rounds"] == 2.0 and metrics["dynamic_sampling/informative_frac"] == 0.5


def test_a_gold_reward_is_measured_only_when_there_is_one():
    none = GoldReward(None)
    samples = [{"score": 1.0}]
    assert none.rollout_metrics(["p"], ["r"], lambda t: t) == {} and none.annotate(samples, ["p"], ["r"]) == [{"score": 1.0}]
    gold = GoldReward(lambda prompts, responses: [float(len(r)) for r in responses])
    assert gold.rollout_metrics(["p", "q"], ["ab", "abcd"], lambda t: t) == {"reward/gold_mean": 3.0}
    assert gold.annotate([{"score": 0.0}], ["p"], ["abc"]) == [{"score": 0.0, "gold": 3.0}]
    with pytest.raises(TypeError, match="gold_fn must be a callable"):
        GoldReward("not a function")
    with pytest.raises(ValueError, match="gold_fn"):
        GoldReward(lambda p, r: [float("nan")] * len(r)).rollout_metrics(["p"], ["r"], lambda t: t)
