"""Rollout correction: the weights against loops, the identity with no gap, and the trainer's use.

Chapter 9 induces a gap between the sampler and the trainer (a perturbed copy of the weights,
or bfloat16 sampling) and corrects it; these tests hold what it relies on.
"""

import math

import pytest
import torch

from conftest import small_config
from ppo_lab import PPOConfig
from ppo_lab.rollout_correction import correction_weights, gap_metrics, log_ratios
from ppo_lab.trainer import PPOTrainer


def _batch(seed=0, gap=0.5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=g) * 3
    sampler = old + gap * torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return old, sampler, mask


def _slow_weights(old, sampler, mask, kind, level, low, high):
    """The weights one token at a time, from the definitions."""
    B, T = old.shape
    out = torch.zeros(B, T)
    for b in range(B):
        seq = math.exp(sum(old[b, t].item() - sampler[b, t].item() for t in range(T) if mask[b, t]))
        for t in range(T):
            if not mask[b, t]:
                continue
            rho = seq if level == "sequence" else math.exp(old[b, t].item() - sampler[b, t].item())
            if kind == "tis":
                out[b, t] = min(rho, high)
            else:
                out[b, t] = rho if low <= rho <= high else 0.0
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("kind,low,high", [("tis", 0.0, 2.0), ("tis", 0.0, 1.1), ("mis", 0.5, 2.0), ("mis", 0.0, 1.5)])
def test_correction_weights_match_the_definitions(kind, level, low, high):
    old, sampler, mask = _batch()
    w = correction_weights(old, sampler, mask, kind=kind, level=level, low=low, high=high)
    torch.testing.assert_close(w, _slow_weights(old, sampler, mask, kind, level, low, high), rtol=1e-5, atol=1e-6)
    assert (w[mask == 0] == 0).all() and (w >= 0).all()
    assert not w.requires_grad


@pytest.mark.parametrize("kind", ["none", "tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_every_correction_is_the_identity_without_a_gap(kind, level):
    old, _, mask = _batch()
    w = correction_weights(old, old.clone(), mask, kind=kind, level=level, low=0.5, high=2.0)
    torch.testing.assert_close(w, mask)
    metrics = gap_metrics(old, old.clone(), mask, w, kind=kind, level=level)
    assert metrics["sampler/kl"].item() == 0.0 and metrics["sampler/ess"].item() == pytest.approx(1.0)
    assert metrics["sampler/corrected_frac"].item() == 0.0


def test_sequence_log_ratios_sum_each_response_over_its_real_tokens():
    old, sampler, mask = _batch()
    seq = log_ratios(old, sampler, mask, "sequence")
    for b in range(4):
        total = ((old[b] - sampler[b]) * mask[b]).sum()
        torch.testing.assert_close(seq[b][mask[b] == 1], total.expand(int(mask[b].sum())))
    assert (seq[mask == 0] == 0).all()


def test_gap_metrics_match_their_formulas():
    old, sampler, mask = _batch(seed=3)
    w = correction_weights(old, sampler, mask, kind="tis", high=1.2)
    m = gap_metrics(old, sampler, mask, w, kind="tis")
    rho = [math.exp(old[b, t] - sampler[b, t]) for b in range(4) for t in range(6) if mask[b, t]]
    k3 = sum(r - 1 - math.log(r) for r in rho) / len(rho)
    ess = (sum(rho) / len(rho)) ** 2 / (sum(r * r for r in rho) / len(rho))
    assert m["sampler/kl"].item() == pytest.approx(k3, rel=1e-5)
    assert m["sampler/ess"].item() == pytest.approx(ess, rel=1e-5) and ess < 1
    assert m["sampler/corrected_frac"].item() == pytest.approx(sum(r > 1.2 for r in rho) / len(rho))


def test_correction_weights_refuse_bad_arguments():
    old, sampler, mask = _batch()
    with pytest.raises(ValueError, match="low < high"):
        correction_weights(old, sampler, mask, kind="mis", low=2.0, high=2.0)
    with pytest.raises(ValueError, match="kind"):
        correction_weights(old, sampler, mask, kind="clip")
    with pytest.raises(ValueError, match="level"):
        correction_weights(old, sampler, mask, level="geometric")


def test_the_config_refuses_a_correction_in_the_bypass_form():
    with pytest.raises(ValueError, match="bypass form"):
        PPOConfig(**{"sampler.correction": "tis", "sampler.old_logprobs_from": "sampling"})
    with pytest.raises(ValueError, match="sampler.correction_low"):
        PPOConfig(**{"sampler.correction": "mis", "sampler.correction_low": 3.0, "sampler.correction_high": 2.0})
    assert PPOConfig(**{"sampler.correction": "tis"}).sampler.old_logprobs_from == "auto"  # auto picks the forward


def _history(tmp_path, name, *settings):
    trainer = PPOTrainer(small_config(tmp_path / name, *settings))
    return trainer, trainer.train()


def test_without_a_gap_a_corrected_run_is_the_plain_run(tiny_path, tmp_path):
    _, plain = _history(tmp_path, "plain", {"sampler.old_logprobs_from": "forward"})
    for kind in ("tis", "mis"):
        _, corrected = _history(tmp_path, kind, {"sampler.correction": kind, "sampler.correction_low": 0.5})
        for a, b in zip(plain, corrected):
            for key in ("reward/score_mean", "loss/policy", "policy/approx_kl", "objective/kl", "sampler/kl", "sampler/corrected_frac"):
                # (the sampling loop's and the forward's log-probs agree to float round-off, ~1e-6)
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (kind, key)
        assert plain[0]["sampler/kl"] < 1e-6 and plain[0]["sampler/ess"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("accumulation", [1, 2, 4])
def test_with_a_gap_the_first_ratio_is_one_in_the_decoupled_form_for_any_micro_batch(tiny_path, tmp_path, accumulation):
    trainer = PPOTrainer(small_config(tmp_path, {"sampler.noise": 0.2, "batch.accumulation_steps": accumulation, "sampler.correction": "tis"}))
    first = trainer.first_step_metrics()
    assert first["policy/ratio_min"] == pytest.approx(1.0, abs=1e-5) and first["policy/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    metrics = trainer.iterate()
    assert metrics["sampler/kl"] > 1e-3 and metrics["sampler/ess"] < 1


def test_in_the_bypass_form_the_gap_enters_the_ratio(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"sampler.noise": 0.2, "sampler.old_logprobs_from": "sampling"}))
    first = trainer.first_step_metrics()
    assert first["policy/ratio_max"] > 1.01 and first["policy/ratio_min"] < 0.99
    assert "sampler/kl" not in trainer.iterate()  # no trainer forward: nothing to compare with


def test_the_weights_reach_the_loss(tiny_path, tmp_path):
    # a band this narrow masks many tokens; on-policy (the decoupled form's first step, ratio 1)
    # the clipped loss of a token is -w A, so the policy loss is the mean of -w A over the tokens
    trainer = PPOTrainer(small_config(tmp_path, {
            "sampler.noise": 0.2, "sampler.correction": "mis", "sampler.correction_low": 0.999,
            "sampler.correction_high": 1.001,
        }))
    ro = trainer.rollout(trainer.next_prompts())
    weights = ro.weights
    assert weights is not None and (weights[ro.mask == 1] == 0).float().mean() > 0.2
    _, advantages, returns = trainer.advantages(ro)
    trainer.set_training(True)
    rows = torch.arange(len(ro))
    _, weighted = trainer.minibatch_loss(ro, rows, advantages, returns)
    m = ro.mask.float()
    assert weighted["loss/policy"].item() == pytest.approx(-((weights * advantages * m).sum() / m.sum()).item(), abs=1e-6)
    ro.weights = None
    _, plain = trainer.minibatch_loss(ro, rows, advantages, returns)
    assert plain["loss/policy"].item() == pytest.approx(-((advantages * m).sum() / m.sum()).item(), abs=1e-6)


def test_the_sampler_copy_is_redrawn_each_iteration_and_the_same_for_the_same_seed(tiny_path, tmp_path):
    a = PPOTrainer(small_config(tmp_path / "a", {"sampler.noise": 0.1}))
    b = PPOTrainer(small_config(tmp_path / "b", {"sampler.noise": 0.1}))
    first = [p.clone() for p in a.sampler.model(a.lm, a.iteration).parameters()]
    assert all(torch.equal(x, y) for x, y in zip(first, b.sampler.model(b.lm, b.iteration).parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(first, a.lm.parameters()))
    a.iteration += 1
    assert not all(torch.equal(x, y) for x, y in zip(first, a.sampler.model(a.lm, a.iteration).parameters()))


def test_the_expected_logit_gradient_matches_sampling_and_is_unbiased_with_full_weights():
    from ppo_lab.rollout_correction import expected_logit_gradient

    g = torch.Generator().manual_seed(0)
    z_old, z_s = torch.randn(2, 5, generator=g, dtype=torch.float64), torch.randn(2, 5, generator=g, dtype=torch.float64)
    p_old, p_s = torch.softmax(z_old, -1), torch.softmax(z_s, -1)
    reward = torch.randn(2, 5, generator=g, dtype=torch.float64)
    adv = reward - (p_old * reward).sum(-1, keepdim=True)
    # the on-policy gradient of E_old[r] with respect to the logits, by autograd
    z = z_old.clone().requires_grad_()
    (torch.softmax(z, -1) * reward).sum().backward()
    full, _ = expected_logit_gradient(p_old, p_s, adv, p_old / p_s)
    torch.testing.assert_close(full, z.grad)
    # a loop over the vocabulary for the biased estimate (no weights) and its second moment
    none, moment = expected_logit_gradient(p_old, p_s, adv, torch.ones_like(adv))
    for n in range(2):
        g_loop, m_loop = torch.zeros(5, dtype=torch.float64), 0.0
        for y in range(5):
            e = torch.zeros(5, dtype=torch.float64)
            e[y] = 1
            estimate = adv[n, y] * (e - p_old[n])
            g_loop += p_s[n, y] * estimate
            m_loop += p_s[n, y] * (estimate**2).sum()
        torch.testing.assert_close(none[n], g_loop)
        assert moment[n].item() == pytest.approx(m_loop.item())
    assert (none - z.grad).abs().max() > 1e-3  # without the weights the expectation is off
