"""The policy-loss registry, the rollout metrics and the critic's pooling, against slow references."""

import pytest
import torch

import ppo_lab
from ppo_lab.losses import POLICY_LOSSES, get_policy_loss, register_policy_loss
from ppo_lab.metrics import rollout_metrics
from ppo_lab.models import causal_mean_pool
from ppo_lab.sampling import Sampling


def test_the_registry_holds_the_policy_losses_and_names_the_valid_ones():
    assert {"clip", "ppo_penalty", "gspo", "cispo"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match=r"unknown policy loss 'clipp'; valid values are: 'cispo', 'clip', 'gspo', 'ppo_penalty'"):
        get_policy_loss("clipp")
    with pytest.raises(ValueError, match=r"loss.policy = 'clipp' is not allowed; valid values are: 'cispo', 'clip', 'gspo', 'ppo_penalty'"):
        ppo_lab.PPOConfig(**{"loss.policy": "clipp"})
    with pytest.raises(ValueError, match=r"already registered"):
        register_policy_loss("clip")(lambda *a, **k: None)


def test_every_policy_loss_takes_the_same_arguments():
    g = torch.Generator().manual_seed(0)
    lp, old, adv = (torch.randn(3, 5, generator=g) * 0.1 for _ in range(3))
    mask = torch.ones(3, 5)
    settings = dict(clip_eps=0.2, clip_eps_high=None, dual_clip=None, penalty_beta=0.5, loss_agg="token-mean")
    for name, fn in POLICY_LOSSES.items():
        loss, metrics = fn(lp, old, adv, mask, **settings)
        assert loss.dim() == 0 and "policy/approx_kl" in metrics, name
    clip, _ = get_policy_loss("clip")(lp, old, adv, mask, **settings)
    torch.testing.assert_close(clip, ppo_lab.clipped_policy_loss(lp, old, adv, mask, 0.2)[0])
    penalty, _ = get_policy_loss("ppo_penalty")(lp, old, adv, mask, **settings)
    torch.testing.assert_close(penalty, ppo_lab.kl_penalized_policy_loss(lp, old, adv, mask, 0.5)[0])


def test_a_registered_policy_loss_trains_through_the_config(tiny_path, tmp_path):
    from conftest import small_config

    calls = []

    @register_policy_loss("test-reinforce")
    def reinforce(logprobs, old_logprobs, advantages, mask, *, loss_agg, **_):
        calls.append(loss_agg)
        return ppo_lab.aggregate_loss(-logprobs * advantages, mask, loss_agg), {}

    try:
        trainer = ppo_lab.PPOTrainer(small_config(tmp_path, {"loss.policy": "test-reinforce", "optim.early_stop_kl": None, "run.iterations": 1}))
        metrics = trainer.train()[-1]
        assert calls and metrics["policy/steps"] == 4 and "loss/policy" in metrics
    finally:
        POLICY_LOSSES.pop("test-reinforce")


def _rollout(seed=0, b=6, t=5):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(t) < torch.randint(1, t + 1, (b, 1), generator=g)).float()
    return dict(
        scores=torch.randn(b, generator=g) * 3, ended=torch.rand(b, generator=g) < 0.5,
        old_logprobs=-torch.rand(b, t, generator=g) * 3, ref_logprobs=-torch.rand(b, t, generator=g) * 3,
        entropy=torch.rand(b, t, generator=g), mask=mask,
    )


def _slow_objective(r, kl_coef, estimator, score):
    """sum over each response's real tokens of the KL estimate, by loops; the objective's two metrics."""
    penalty, total = [], []
    for b in range(len(score)):
        kl = 0.0
        for t in range(r["mask"].shape[1]):
            if r["mask"][b, t]:
                x = (r["old_logprobs"][b, t] - r["ref_logprobs"][b, t]).item()
                kl += {"k1": x, "k2": 0.5 * x * x, "k3": (torch.exp(torch.tensor(-x)) - 1 + x).item(), "abs": abs(x)}[estimator]
        penalty.append(-kl_coef * kl)
        total.append(score[b] - kl_coef * kl)
    return sum(penalty) / len(penalty), sum(total) / len(total)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("kl_in", ["reward", "loss"])
@pytest.mark.parametrize("adjust", [dict(), {"reward.clip": 1.0}, {"reward.truncated_penalty": 2.0}, {"reward.normalize": True}])
def test_objective_metrics_follow_the_configured_estimator_and_the_adjusted_score(estimator, kl_in, adjust):
    # before: non_score_reward used k1 whatever kl_estimator said (and 0 with kl_in="loss"), and
    # rlhf_reward used the raw score, ignoring score_clip, score_norm and truncated_penalty
    r, kl_coef = _rollout(), 0.3
    score = ppo_lab.adjust_scores(r["scores"], r["ended"], adjust.get("truncated_penalty"), adjust.get("score_norm", False))
    if "score_clip" in adjust:
        score = score.clamp(-adjust["score_clip"], adjust["score_clip"])
    beta_in_reward = kl_coef if kl_in == "reward" else 0.0
    rewards = ppo_lab.shape_rewards(
        ppo_lab.adjust_scores(r["scores"], r["ended"], adjust.get("truncated_penalty"), adjust.get("score_norm", False)),
        r["old_logprobs"], r["ref_logprobs"], r["mask"], beta_in_reward, estimator, adjust.get("score_clip"),
    )
    got = rollout_metrics(**r, rewards=rewards, advantages=None, kl_coef=kl_coef, kl_in=kl_in, kl_estimator=estimator)
    penalty, total = _slow_objective(r, kl_coef, estimator, score.tolist())
    assert got["objective/non_score_reward"].item() == pytest.approx(penalty, rel=1e-5, abs=1e-6)
    assert got["objective/rlhf_reward"].item() == pytest.approx(total, rel=1e-5, abs=1e-6)
    kl, _ = _slow_objective(r, -1.0, "k1", [0.0] * len(score))  # objective/kl is always k1
    assert got["objective/kl"].item() == pytest.approx(kl, rel=1e-5, abs=1e-6)


def test_causal_mean_pool_matches_a_loop():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    attention = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]])
    got = causal_mean_pool(hidden, attention)
    for b in range(3):
        for t in range(6):
            real = [hidden[b, s] for s in range(t + 1) if attention[b, s]]
            want = torch.stack(real).mean(0) if real else torch.zeros(4, dtype=torch.float64)
            torch.testing.assert_close(got[b, t], want)


def test_sampling_is_one_keyword_only_object():
    with pytest.raises(TypeError):
        Sampling(12, 0.7)  # positional settings are what it replaces
    s = Sampling(max_new_tokens=12, temperature=0.7, stop_ids=[2])
    assert s.stop_ids == (2,) and s.top_k == 0 and s.top_p == 1.0
    with pytest.raises(ValueError, match=r"sampling.max_new_tokens = 0 must be an integer >= 1"):
        Sampling(max_new_tokens=0)
    with pytest.raises(TypeError, match=r"`sampling` must be a ppo_lab.Sampling"):
        ppo_lab.generate(torch.nn.Linear(1, 1), None, ["x"], 12)
