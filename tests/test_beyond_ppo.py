"""Chapter 10's estimators, losses, KL-in-the-loss gradients, overlong handling and dynamic
sampling, each against a slow reference written as loops."""

import math

import pytest
import torch

import ppo_lab

import reference as ref
from conftest import SEEDS, random_mask, scribble
from ppo_lab import (
    cispo_policy_loss,
    compute_advantages,
    expected_loss_gradient,
    gspo_policy_loss,
    informative_groups,
    kl_gradient,
    kl_penalty,
    overlong_penalty,
)


def _batch(seed, B=9, T=5):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = random_mask(B, T, g)
    return g, rewards, mask


GROUPS = [3, 1, 3, 7, 1, 7, 3, 1, 7]  # three groups of three, interleaved


def _whiten_reference(values_rows, mask_rows):
    real = [v for row, mr in zip(values_rows, mask_rows) for v, m in zip(row, mr) if m]
    mu = ref.mean(real)
    sd = math.sqrt(ref.var(real) + 1e-8)
    return [[(v - mu) / sd if m else 0.0 for v, m in zip(row, mr)] for row, mr in zip(values_rows, mask_rows)]


# --- estimators ---------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_dr_grpo_is_the_group_mean_without_the_std(seed):
    g, rewards, mask = _batch(seed)
    adv, ret = compute_advantages("dr_grpo", rewards, mask, group_ids=torch.tensor(GROUPS))
    totals = [sum(v for v, m in zip(r, mr) if m) for r, mr in zip(ref.rows(rewards), ref.rows(mask))]
    for b in range(9):
        members = [totals[j] for j, h in enumerate(GROUPS) if h == GROUPS[b]]
        want = totals[b] - sum(members) / len(members)
        for t in range(5):
            assert adv[b, t].item() == pytest.approx(want if mask[b, t] else 0.0, abs=1e-9)
            assert ret[b, t].item() == pytest.approx(totals[b] if mask[b, t] else 0.0, abs=1e-9)
    assert torch.equal(compute_advantages("dr_grpo", scribble(rewards, mask, g), mask, group_ids=GROUPS)[0], adv)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_is_the_batch_whitened_return_to_go(seed, gamma):
    g, rewards, mask = _batch(seed)
    adv, ret = compute_advantages("reinforce_pp", rewards, mask, gamma=gamma)
    G = ref.reward_to_go(rewards, mask, gamma)
    want = _whiten_reference(G, ref.rows(mask))
    torch.testing.assert_close(ret, torch.tensor(G, dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64))
    assert torch.equal(compute_advantages("reinforce_pp", scribble(rewards, mask, g), mask, gamma=gamma)[0], adv)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_baseline_subtracts_the_group_mean_score_then_whitens_over_the_batch(seed):
    g, rewards, mask = _batch(seed)
    scores = torch.randn(9, generator=g, dtype=torch.float64)
    adv, ret = compute_advantages("reinforce_pp_baseline", rewards, mask, group_ids=GROUPS, scores=scores)
    # the reference: take the score's group mean off the last real token, reward-to-go, whiten
    centred = []
    for b, (r_row, m_row) in enumerate(zip(ref.rows(rewards), ref.rows(mask))):
        members = [scores[j].item() for j, h in enumerate(GROUPS) if h == GROUPS[b]]
        row = list(r_row)
        row[ref.real_positions(m_row)[-1]] -= sum(members) / len(members)
        centred.append(row)
    G = ref.reward_to_go(torch.tensor(centred, dtype=torch.float64), mask, 1.0)
    torch.testing.assert_close(ret, torch.tensor(G, dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor(_whiten_reference(G, ref.rows(mask)), dtype=torch.float64))
    # a constant added to every score of a group changes nothing: the baseline takes it off
    shifted = scores + torch.tensor([5.0 if h == 3 else 0.0 for h in GROUPS], dtype=torch.float64)
    moved = rewards.clone()
    last = torch.tensor([ref.real_positions(m)[-1] for m in ref.rows(mask)])
    moved[torch.arange(9), last] += shifted - scores
    torch.testing.assert_close(compute_advantages("reinforce_pp_baseline", moved, mask, group_ids=GROUPS, scores=shifted)[0], adv)


def test_reinforce_pp_baseline_needs_scores_and_groups():
    rewards, mask = torch.zeros(4, 2), torch.ones(4, 2)
    with pytest.raises(ValueError, match="needs `scores`"):
        compute_advantages("reinforce_pp_baseline", rewards, mask, group_ids=[0, 0, 1, 1])
    with pytest.raises(ValueError, match="need `group_ids`"):
        compute_advantages("reinforce_pp_baseline", rewards, mask, scores=torch.zeros(4))
    with pytest.raises(ValueError, match=r"`scores` has shape \(3,\)"):
        compute_advantages("reinforce_pp_baseline", rewards, mask, group_ids=[0, 0, 1, 1], scores=torch.zeros(3))


def test_the_group_mean_shrinks_the_expected_gradient_by_n_minus_1_over_n():
    """On a one-token bandit the expected Dr. GRPO advantage-weighted score is (n-1)/n of the
    true gradient (the response's own reward is in its baseline); RLOO's is the gradient."""
    logits = torch.tensor([0.3, -0.2, 0.5])
    reward = torch.tensor([1.0, 0.0, 0.4])
    p = torch.softmax(logits, 0)
    true = p * (reward - (p * reward).sum())  # d E[r] / d logits
    n = 4
    # every ordered group of n actions, weighted by its probability: the exact expectation
    import itertools

    want = {"rloo": torch.zeros(3), "dr_grpo": torch.zeros(3)}
    for group in itertools.product(range(3), repeat=n):
        prob = math.prod(p[a].item() for a in group)
        r = reward[list(group)][:, None]
        for kind in want:
            adv, _ = compute_advantages(kind, r, torch.ones(n, 1), group_ids=[0] * n)
            for a, A in zip(group, adv[:, 0]):
                score = -p.clone()
                score[a] += 1  # d log p(a) / d logits
                want[kind] += prob * A * score / n
    torch.testing.assert_close(want["rloo"], true, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(want["dr_grpo"], true * (n - 1) / n, rtol=1e-5, atol=1e-6)


# --- policy losses ------------------------------------------------------------------------
def _loss_inputs(seed, B=6, T=5, spread=0.3, per_sequence_adv=True):
    g = torch.Generator().manual_seed(seed)
    mask = random_mask(B, T, g)
    old = torch.randn(B, T, generator=g, dtype=torch.float64) - 2
    lp = (old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(B, 1 if per_sequence_adv else T, generator=g, dtype=torch.float64).expand(B, T).clone()
    return g, lp, old, adv, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps_low, eps_high", [(0.2, None), (3e-4, 4e-4), (0.1, 0.3)])
def test_gspo_is_ppo_clip_on_the_geometric_mean_ratio(seed, eps_low, eps_high):
    """Value and gradient of the token form equal the sequence objective's, computed per response."""
    g, lp, old, adv, mask = _loss_inputs(seed)
    loss, metrics = gspo_policy_loss(lp, old, adv, mask, eps_low, eps_high, "seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    lp2 = lp.detach().clone().requires_grad_()
    high = eps_low if eps_high is None else eps_high
    terms, clipped = [], 0
    for b in range(6):
        idx = ref.real_positions(mask[b].tolist())
        s = torch.exp(sum(lp2[b, t] - old[b, t] for t in idx) / len(idx))  # geometric mean
        A = adv[b, 0]
        terms.append(torch.maximum(-A * s, -A * s.clamp(1 - eps_low, 1 + high)))
        clipped += len(idx) * bool(-A * s.clamp(1 - eps_low, 1 + high) > -A * s)
    want = torch.stack(terms).mean()
    (want_grad,) = torch.autograd.grad(want, lp2)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert metrics["policy/clipfrac"].item() == pytest.approx(clipped / mask.sum().item())
    assert torch.equal(gspo_policy_loss(lp, scribble(old, mask, g), adv, mask, eps_low, eps_high, "seq-mean-token-mean")[0], loss)


def test_gspo_moves_less_than_ppo_for_one_outlier_token():
    """One token with ratio 3 in a 10-token response: PPO clips that token alone; GSPO's
    sequence ratio is 3^(1/10) = 1.116, so the whole response stays inside a 0.2 band."""
    old = torch.zeros(1, 10, dtype=torch.float64)
    lp = old.clone()
    lp[0, 4] = math.log(3.0)
    _, m = gspo_policy_loss(lp, old, torch.ones(1, 10, dtype=torch.float64), torch.ones(1, 10), 0.2)
    assert m["policy/ratio_max"].item() == pytest.approx(3 ** 0.1) and m["policy/clipfrac"].item() == 0.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_cispo_gradient_is_the_clipped_weight_times_the_score(seed, agg):
    g, lp, old, adv, mask = _loss_inputs(seed, spread=0.5, per_sequence_adv=False)
    eps_low, eps_high = 10.0, 0.2
    loss, metrics = cispo_policy_loss(lp, old, adv, mask, eps_low, eps_high, agg)
    (grad,) = torch.autograd.grad(loss, lp)
    rows = [[-min(max(math.exp(l - o), 1 - eps_low), 1 + eps_high) * a * l for l, o, a in zip(lr, orow, arow)]
            for lr, orow, arow in zip(ref.rows(lp.detach()), ref.rows(old), ref.rows(adv))]
    assert loss.item() == pytest.approx(ref.aggregate(rows, ref.rows(mask), agg))
    # d/d logprob of -w A logprob, w a constant: -w A, times the aggregation weight of the token
    n = mask.sum(-1, keepdim=True)
    share = mask / mask.sum() if agg == "token-mean" else mask / (n * mask.shape[0])
    w = torch.exp(lp.detach() - old).clamp(1 - eps_low, 1 + eps_high)
    torch.testing.assert_close(grad, -w * adv * share)
    outside = ((torch.exp(lp.detach() - old) > 1 + eps_high) * mask).sum() / mask.sum()
    assert metrics["policy/clipfrac"].item() == pytest.approx(outside.item())


def test_cispo_keeps_the_gradient_ppo_clip_cuts():
    """A positive-advantage token at ratio 1.5: PPO-clip (eps 0.2) gives it no gradient, CISPO
    gives it 1.2 x A x its score."""
    from ppo_lab import clipped_policy_loss

    old = torch.zeros(1, 1, dtype=torch.float64)
    lp = torch.full((1, 1), math.log(1.5), dtype=torch.float64, requires_grad=True)
    adv, mask = torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1)
    (ppo,) = torch.autograd.grad(clipped_policy_loss(lp, old, adv, mask, 0.2)[0], lp)
    (cispo,) = torch.autograd.grad(cispo_policy_loss(lp, old, adv, mask, 0.2)[0], lp)
    assert ppo.item() == 0.0 and cispo.item() == pytest.approx(-1.2)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_on_policy_the_new_losses_give_the_policy_gradient(name):
    """At ratio 1 (the first step of an update) GSPO and CISPO have PPO's gradient (with one
    advantage per response and per-sequence token means for GSPO)."""
    from ppo_lab import clipped_policy_loss

    _, lp, _, adv, mask = _loss_inputs(0)
    old = lp.detach().clone()
    fn = gspo_policy_loss if name == "gspo" else cispo_policy_loss
    (got,) = torch.autograd.grad(fn(lp, old, adv, mask, 0.2, None, "seq-mean-token-mean")[0], lp)
    (want,) = torch.autograd.grad(clipped_policy_loss(lp, old, adv, mask, 0.2, None, None, "seq-mean-token-mean")[0], lp)
    torch.testing.assert_close(got, want)


# --- the KL as a loss: which gradient each estimator gives (Tang and Munos 2025) -------------
def _expected_kl_loss_gradient(kind, logits, ref_logits):
    """E_{x ~ pi}[grad_logits k(x)], exactly: a sum over the vocabulary, the sample held fixed."""
    p = torch.softmax(logits, 0).detach()
    total = torch.zeros_like(logits)
    for x in range(len(logits)):
        z = logits.detach().clone().requires_grad_()
        lp = torch.log_softmax(z, 0)[x].reshape(1, 1)
        ref_lp = torch.log_softmax(ref_logits, 0)[x].reshape(1, 1)
        (g,) = torch.autograd.grad(kl_penalty(lp, ref_lp, kind).sum(), z)
        total += p[x] * g
    return total


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_estimators_as_losses_have_the_gradients_tang_and_munos_derive(seed):
    """k1 as a loss has expected gradient 0; k2's is the gradient of the reverse KL(pi || ref),
    the one the penalty means; k3's is that of the forward KL(ref || pi), another objective."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, generator=g, dtype=torch.float64)
    ref_logits = torch.randn(6, generator=g, dtype=torch.float64)

    def grad_of(kl):
        z = logits.clone().requires_grad_()
        (out,) = torch.autograd.grad(kl(torch.log_softmax(z, 0), torch.log_softmax(ref_logits, 0)), z)
        return out

    reverse = grad_of(lambda lp, lq: (lp.exp() * (lp - lq)).sum())
    forward = grad_of(lambda lp, lq: (lq.exp() * (lq - lp)).sum())
    torch.testing.assert_close(_expected_kl_loss_gradient("k1", logits, ref_logits), torch.zeros(6, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(_expected_kl_loss_gradient("k2", logits, ref_logits), reverse)
    torch.testing.assert_close(_expected_kl_loss_gradient("k3", logits, ref_logits), forward)
    assert not torch.allclose(forward, reverse, atol=1e-3)  # the bias of k3: another direction
    # the package's one-backward versions equal the loop and the closed forms
    for kind in ("k1", "k2", "k3", "abs"):
        torch.testing.assert_close(expected_loss_gradient(logits, ref_logits, kind), _expected_kl_loss_gradient(kind, logits, ref_logits), atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(kl_gradient(logits, ref_logits), reverse)
    torch.testing.assert_close(kl_gradient(logits, ref_logits, reverse=False), forward)


# --- overlong handling --------------------------------------------------------------------
def test_overlong_penalty_matches_the_dapo_formula():
    L, buffer = 20, 4
    lengths = torch.arange(1, L + 1)
    got = overlong_penalty(lengths, L, buffer, factor=0.5)
    for n, v in zip(lengths.tolist(), got.tolist()):
        want = 0.0 if n <= L - buffer else 0.5 * ((L - buffer) - n) / buffer
        assert v == pytest.approx(want)
    assert got[-1].item() == pytest.approx(-0.5)


def test_overlong_penalty_refuses_bad_settings():
    with pytest.raises(ValueError, match="between 1 and the budget"):
        overlong_penalty(torch.tensor([3]), 4, 5)
    with pytest.raises(ValueError, match="longer than the budget"):
        overlong_penalty(torch.tensor([5]), 4, 2)


# --- dynamic sampling ---------------------------------------------------------------------
def test_informative_groups_drop_groups_that_all_scored_alike():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, float("nan"), 1.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    assert informative_groups(scores, groups).tolist() == [False, False, True, True, False, False, True, True, False, False]
    # groups need not be adjacent
    assert informative_groups(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 1, 1, 0])).tolist() == [False, True, True, False]
    assert informative_groups(torch.tensor([float("inf"), float("inf")]), torch.tensor([0, 0])).tolist() == [True, True]


# --- in the trainer -----------------------------------------------------------------------
def _scripted_reward(pattern):
    """A reward that scores response j of every call pattern[j % len(pattern)]: which groups
    are informative is then known in advance."""

    def reward(prompts, responses):
        return [float(pattern[j % len(pattern)]) for j in range(len(responses))]

    return reward


def test_dynamic_sampling_fills_the_batch_with_informative_groups(tiny_path, tmp_path):
    from conftest import small_config
    from ppo_lab.trainer import PPOTrainer

    # groups of 2: (1, 1) teaches nothing, (0, 1) does: half of every rollout's groups pass
    cfg = small_config(tmp_path, {
            "critic.design": "none", "advantage.estimator": "grpo", "sampling.responses_per_prompt": 2,
            "batch.rollout": 8, "batch.minibatch": 4, "sampling.dynamic": True,
            "sampling.dynamic_max_rounds": 3, "advantage.whiten": False,
        })
    trainer = PPOTrainer(cfg, reward_fn=_scripted_reward([1, 1, 0, 1]))
    ro, metrics = trainer.collect()
    assert len(ro) == 8 and metrics == {"dynamic_sampling/responses": 16.0, "dynamic_sampling/rounds": 2.0, "dynamic_sampling/informative_frac": 0.5, "dynamic_sampling/score_mean": 0.75}
    assert ro.scores.view(-1, 2).tolist() == [[0.0, 1.0]] * 4  # every group informative
    assert ro.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # the rows are the rollouts' own: the prompts match their tokens, and the log-probs the tokens
    _, advantages, returns = trainer.advantages(ro)
    trainer.set_training(True)
    _, m = trainer.minibatch_loss(ro, torch.arange(8), advantages, returns)
    assert abs(m["policy/ratio_min"].item() - 1) < 1e-5 and abs(m["policy/ratio_max"].item() - 1) < 1e-5
    ids = trainer.tokenizer(ro.prompts, add_special_tokens=False)["input_ids"]
    for row, prompt_ids in enumerate(ids):
        real = ro.query_ids[row][ro.query_mask[row].bool()].tolist()
        assert real == prompt_ids


def test_dynamic_sampling_fills_a_short_batch_with_dropped_groups(tiny_path, tmp_path):
    from conftest import small_config
    from ppo_lab.trainer import PPOTrainer

    cfg = small_config(tmp_path, {
            "critic.design": "none", "advantage.estimator": "grpo", "sampling.responses_per_prompt": 2,
            "batch.rollout": 8, "batch.minibatch": 4, "sampling.dynamic": True,
            "sampling.dynamic_max_rounds": 2,
        })
    trainer = PPOTrainer(cfg, reward_fn=_scripted_reward([1, 1, 1, 1, 1, 1, 0, 1]))  # one group in four
    ro, metrics = trainer.collect()
    assert len(ro) == 8 and metrics["dynamic_sampling/rounds"] == 2.0 and metrics["dynamic_sampling/informative_frac"] == 0.25
    assert metrics["dynamic_sampling/score_mean"] == 0.875  # over all 16 drawn responses, not the batch's 0.75
    assert ro.scores.view(-1, 2).tolist() == [[0.0, 1.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    history = trainer.train(1)
    assert history[0]["policy/steps"] >= 1


def test_dynamic_sampling_resumes_exactly(tiny_path, tmp_path):
    import dataclasses

    from conftest import small_config
    from ppo_lab.trainer import PPOTrainer

    cfg = small_config(tmp_path, {
            "critic.design": "none", "advantage.estimator": "grpo", "sampling.responses_per_prompt": 2,
            "batch.rollout": 8, "batch.minibatch": 4, "sampling.dynamic": True, "run.iterations": 3,
            "run.save_interval": 1, "data.task": "arithmetic-small", "sampling.max_new_tokens": 4,
        })
    whole = PPOTrainer(cfg)
    whole.train()
    first = PPOTrainer(cfg.replace({"run.output_dir": str(tmp_path / "b"), "run.iterations": 3}))
    first.train(2)
    first.save_checkpoint()
    resumed = PPOTrainer(first.config.replace({"run.resume_from": "latest"}))
    resumed.train()
    for a, b in zip(whole.bare(whole.policy).state_dict().values(), resumed.bare(resumed.policy).state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_overlong_penalty_and_filter_reach_the_advantages(tiny_path, tmp_path):
    from conftest import small_config
    from ppo_lab.trainer import PPOTrainer

    cfg = small_config(tmp_path, {
            "critic.design": "none", "advantage.estimator": "rloo", "sampling.responses_per_prompt": 2,
            "sampling.max_new_tokens": 3, "reward.overlong_buffer": 2, "reward.overlong_penalty": 0.5,
            "advantage.whiten": False, "kl.coef": 0.0,
        })
    trainer = PPOTrainer(cfg, reward_fn=lambda prompts, responses: [0.0] * len(responses))
    ro = trainer.rollout(trainer.next_prompts())
    lengths = ro.mask.sum(-1)
    rewards, advantages, _ = trainer.advantages(ro)
    penalty = 0.5 * torch.clamp((3 - 2 - lengths) / 2, max=0.0)
    torch.testing.assert_close(rewards.sum(-1), penalty.to(rewards.dtype))  # the score 0 plus the penalty
    assert bool((lengths > 1).any())  # (the case is not empty)
    trainer.config.advantage.drop_truncated = True
    _, filtered, _ = trainer.advantages(ro)
    assert bool((~ro.ended).any()) and bool(ro.ended.any())
    assert bool((filtered[~ro.ended] == 0).all())
    torch.testing.assert_close(filtered[ro.ended], advantages[ro.ended])
    # with whitening, the truncated responses do not shape the others' mean and std
    trainer.config.advantage.whiten = True
    _, white, _ = trainer.advantages(ro)
    kept = ro.mask * ro.ended[:, None]
    torch.testing.assert_close(white, ppo_lab.masked_whiten(advantages, kept))


@pytest.mark.parametrize("name", ["ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo", "cispo"])
def test_each_algorithm_preset_trains_evaluates_saves_and_resumes(tiny_path, tmp_path, name):
    from conftest import train_evaluate_resume
    from ppo_lab import PPOConfig
    from ppo_lab.config import ALGORITHM_PRESETS

    assert name in ALGORITHM_PRESETS
    cfg = PPOConfig.from_yaml(name, **{
            "run.iterations": 2, "batch.rollout": 16, "batch.minibatch": 8, "run.eval_interval": 1,
            "run.eval_count": 4, "run.save_interval": 1, "run.progress_bar": False,
            "run.output_dir": str(tmp_path / "run"),
        })
    train_evaluate_resume(cfg)


# --- the bandit with a known gradient (chapter 10) -------------------------------------------
P = torch.tensor([0.05, 0.3, 0.6, 0.95], dtype=torch.float64)


def test_bandit_expectations_against_the_closed_forms():
    from ppo_lab.bandit import expected_gradient, true_gradient

    for n in (2, 4, 8):
        torch.testing.assert_close(expected_gradient("rloo", P, n), true_gradient(P))
        torch.testing.assert_close(expected_gradient("dr_grpo", P, n), true_gradient(P) * (n - 1) / n)
    # dividing by each group's std weighs the prompts differently: the nearly always (or never)
    # solved ones, whose groups' std is small, gain the most, symmetrically in p and 1 - p
    gain = expected_gradient("grpo", P, 8) / true_gradient(P)
    assert gain.max() / gain.min() > 1.25 and gain[0] == pytest.approx(gain[3].item()) and gain[0] > gain[1] > gain[2]
    with pytest.raises(ValueError, match="sample 'reinforce_pp'"):
        expected_gradient("reinforce_pp", P, 8)


@pytest.mark.parametrize("name", ["rloo", "grpo", "dr_grpo"])
def test_sampled_bandit_gradients_average_to_the_exact_expectation(name):
    from ppo_lab.bandit import expected_gradient, sampled_gradients

    g = sampled_gradients(name, P, 4, 3000, torch.Generator().manual_seed(0))
    se = g.std(0) / math.sqrt(len(g))
    assert bool(((g.mean(0) - expected_gradient(name, P, 4)).abs() < 4 * se + 1e-12).all())


def test_the_preset_table_lists_each_presets_algorithm_fields():
    """book/guide_algorithms.md, "Beyond PPO": one row per algorithm preset, naming exactly the fields its YAML sets
    under its `# --- the algorithm ---` line, with their values."""
    import re
    from pathlib import Path

    import yaml

    from ppo_lab.config import ALGORITHM_PRESETS, PRESETS

    root = Path(__file__).resolve().parents[1]
    section = (root / "book" / "guide_algorithms.md").read_text().split("## Beyond PPO", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_]+)` \| [^|]+ \| (.+) \|$", section, flags=re.M)}
    assert sorted(rows) == sorted(ALGORITHM_PRESETS)
    for name in ALGORITHM_PRESETS:
        algo = yaml.safe_load((PRESETS / f"{name}.yaml").read_text().split("# --- the algorithm ---", 1)[1])
        listed = dict(item.split(": ", 1) for item in re.findall(r"`([^`]+)`", rows[name]))
        assert {k: yaml.safe_load(v) for k, v in listed.items()} == algo, name


def test_the_trainer_normalises_seq_mean_token_sum_norm_by_the_budget_not_the_padded_width():
    """Dr. GRPO's constant is the generation budget: a batch padded to 4 tokens, with a budget of
    10, is divided by 10 (the padded width changes from batch to batch)."""
    from ppo_lab import PPOConfig
    from ppo_lab.objective import Objective

    cfg = PPOConfig(**{
            "loss.aggregation": "seq-mean-token-sum-norm", "sampling.max_new_tokens": 10,
            "critic.design": "none", "advantage.estimator": "dr_grpo", "sampling.responses_per_prompt": 2,
            "kl.placement": "loss", "kl.coef": 0.1, "loss.entropy_coef": 0.01,
        })
    _, lp, old, adv, mask = _loss_inputs(3, B=4, T=4)
    ref = old - 0.1
    entropy = torch.rand(4, 4, dtype=torch.float64)
    batch = {"mask": mask, "old_logprobs": old, "ref_logprobs": ref, "advantages": adv}
    loss, metrics = Objective(cfg).loss(logprobs=lp, entropy=entropy, values=None, batch=batch, kl_coef=0.1, penalty_beta=0.0)

    def by(L):
        policy = clipped_policy_loss_ref(lp, old, adv, mask, L)
        ent = aggregate(entropy, mask, L)
        kl = aggregate(kl_penalty(lp, ref, "k1"), mask, L)
        return policy - 0.01 * ent + 0.1 * kl

    from ppo_lab import aggregate_loss, clipped_policy_loss

    def clipped_policy_loss_ref(lp, old, adv, mask, L):
        return clipped_policy_loss(lp, old, adv, mask, 0.2, None, None, "seq-mean-token-sum-norm", L)[0]

    def aggregate(x, mask, L):
        return aggregate_loss(x, mask, "seq-mean-token-sum-norm", L)

    torch.testing.assert_close(loss, by(10.0))
    assert not torch.allclose(loss, by(4.0))


def test_overlong_handling_is_refused_when_no_response_can_stop():
    from ppo_lab import PPOConfig

    for fields in ({"advantage.drop_truncated": True}, {"reward.overlong_buffer": 2}):
        with pytest.raises(ValueError, match="ignore_eos makes every response exactly max_new_tokens long"):
            PPOConfig(**fields, **{"sampling.ignore_eos": True})
    with pytest.raises(ValueError, match="reward.overlong_buffer = 20 is longer than the budget sampling.max_new_tokens = 12"):
        PPOConfig(**{"reward.overlong_buffer": 20})
    with pytest.raises(ValueError, match="sampling.dynamic drops the groups"):
        PPOConfig(**{"sampling.dynamic": True})
    with pytest.raises(ValueError, match="reinforce_pp_baseline"):
        PPOConfig(**{
                "advantage.estimator": "reinforce_pp_baseline", "critic.design": "none",
                "sampling.responses_per_prompt": 2, "advantage.whiten_rewards": True,
            })
