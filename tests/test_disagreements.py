"""The other implementations' choices (ppo_lab.disagreements, Appendix A): each function against a
slow reference, each `reproduce` switch end to end (evaluation and a checkpoint) with its effect,
and the decisions table of book/reference_decisions.md kept equal to `DECISIONS`."""

import re
from pathlib import Path

import pytest
import torch

from conftest import SEEDS, random_mask, scribble, small_config
from ppo_lab import PPOConfig
from ppo_lab.disagreements import DECISIONS, OTHER_CHOICES, Choices, dropout_on, gae_over_padding, k3_clamped, k3_exp_minus_one, score_past_last, whiten_with_padding
from ppo_lab.gae import compute_gae
from ppo_lab.kl import kl_penalty
from ppo_lab.shaping import shape_rewards
from ppo_lab.trainer import PPOTrainer


# --- the functions, against loops ---------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_score_past_last_moves_each_score_one_position_on(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 5
    mask = random_mask(B, T, g)
    scores, lp, ref = torch.randn(B, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)
    ours = shape_rewards(scores, lp, ref, mask, 0.1)
    moved = score_past_last(ours, scores, mask)
    expected = shape_rewards(torch.zeros_like(scores), lp, ref, mask, 0.1)
    for b in range(B):
        n = int(mask[b].sum())
        expected[b, min(n, T - 1)] += scores[b]  # one past the last real token; the last column keeps it
    torch.testing.assert_close(moved, expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_over_padding_is_the_plain_recursion_over_every_position(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, gamma, lam = 4, 7, 0.9, 0.8
    mask = random_mask(B, T, g)
    r, v = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)
    adv, ret = gae_over_padding(r, v, mask, gamma, lam)
    for b in range(B):
        a = 0.0
        for t in reversed(range(T)):
            next_v = v[b, t + 1].item() if t + 1 < T else 0.0
            a = r[b, t].item() + gamma * next_v - v[b, t].item() + gamma * lam * a
            assert adv[b, t].item() == pytest.approx(a, abs=1e-12)
            assert ret[b, t].item() == pytest.approx(a + v[b, t].item(), abs=1e-12)
    # with no padding it is compute_gae; with padding, what the critic says there leaks in
    ones = torch.ones_like(mask)
    torch.testing.assert_close(gae_over_padding(r, v, ones, gamma, lam)[0], compute_gae(r, v, ones, gamma, lam)[0])
    padded = mask.sum(-1) < T
    assert padded.any()
    leaked = gae_over_padding(r, scribble(v, mask, g), mask, gamma, lam)[0]
    assert not torch.allclose((leaked * mask)[padded], (adv * mask)[padded])


def test_whitening_with_padding_counts_the_padded_zeros():
    adv = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float64)
    everything = adv.flatten()
    torch.testing.assert_close(whiten_with_padding(adv, mask), ((everything - everything.mean()) / (everything.var(unbiased=False).sqrt() + 1e-8)).view(2, 4))
    real = whiten_with_padding(adv, mask)[mask.bool()]
    assert abs(real.mean().item()) > 0.3  # over the real tokens it is no longer centred


def test_the_k3_forms_agree_with_kl_penalty_where_they_should_and_part_where_they_should_not():
    g = torch.Generator().manual_seed(0)
    lp, ref = torch.randn(50, 8, generator=g, dtype=torch.float64), torch.randn(50, 8, generator=g, dtype=torch.float64) * 0.3
    lp = ref + torch.randn(50, 8, generator=g, dtype=torch.float64) * 0.5  # |log r| < 2.5: k3 < 10
    torch.testing.assert_close(k3_exp_minus_one(lp, ref), kl_penalty(lp, ref, "k3"))
    torch.testing.assert_close(k3_clamped(lp, ref), kl_penalty(lp, ref, "k3"))
    # tiny log-ratios in float32: exp(x) - 1 cancels, expm1 does not (exact k3 ~ x^2 / 2)
    x = torch.logspace(-7, -3, 200, dtype=torch.float64)
    exact = x.expm1() - x
    zeros = torch.zeros_like(x, dtype=torch.float32)
    err_trl = (k3_exp_minus_one(zeros, x.float()).double() - exact).abs().max().item()
    err_ours = (kl_penalty(zeros, x.float(), "k3").double() - exact).abs().max().item()
    assert err_ours < 1e-3 * err_trl
    # the clamps cap the penalty of a token the reference finds very unlikely
    assert k3_clamped(torch.zeros(1, 1), torch.full((1, 1), 30.0)).item() == 10.0
    assert kl_penalty(torch.zeros(1, 1, dtype=torch.float64), torch.full((1, 1), 30.0, dtype=torch.float64), "k3").item() > 1e12


def test_dropout_on_sets_every_dropout_module():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0), torch.nn.Sequential(torch.nn.Dropout(0.0)))
    dropout_on(model, 0.25)
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == [0.25, 0.25]


# --- the switch --------------------------------------------------------------------------------
def test_reproduce_refuses_an_unknown_name_and_a_recursion_without_gae():
    with pytest.raises(ValueError, match="reproduce names 'score-on-eos'"):
        PPOConfig(**{"run.reproduce": "dropout-on, score-on-eos"})
    with pytest.raises(ValueError, match="gae-over-padding"):
        PPOConfig(**{
                "run.reproduce": "gae-over-padding", "advantage.estimator": "grpo", "critic.design": "none",
                "sampling.responses_per_prompt": 2,
            })
    assert PPOConfig(**{"run.reproduce": " dropout-on ,whiten-with-padding "}).run.reproduce  # spaces are fine


@pytest.fixture(scope="module")
def plain_first_step(tiny_path, tmp_path_factory):
    return PPOTrainer(small_config(tmp_path_factory.mktemp("plain"), {"sampling.temperature": 0.7})).first_step_metrics()


@pytest.mark.parametrize("choice", OTHER_CHOICES)
def test_each_other_choice_trains_evaluates_checkpoints_and_changes_what_it_should(tiny_path, tmp_path, choice, plain_first_step):
    cfg = small_config(tmp_path, {"run.reproduce": choice, "sampling.temperature": 0.7, "run.eval_interval": 1, "run.save_interval": 1})
    trainer = PPOTrainer(cfg)
    first = trainer.first_step_metrics()
    off_policy = choice in ("temperature-1-in-scoring", "dropout-on")
    # ppo_lab's own run starts on-policy; these two choices do not, the others do
    assert abs(plain_first_step["policy/ratio_max"] - 1) < 1e-5 and abs(plain_first_step["policy/ratio_min"] - 1) < 1e-5
    assert (max(abs(first["policy/ratio_max"] - 1), abs(first["policy/ratio_min"] - 1)) > 1e-2) == off_policy
    history = trainer.train()
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(row["objective/kl"])) for row in history)
    assert "eval/score_mean" in history[-1] and (Path(cfg.run.output_dir) / "checkpoints").is_dir() and (Path(cfg.run.output_dir) / "policy").is_dir()
    # after training: the critic's head starts at zero, so its values on padding are 0 before it
    ro = trainer.rollout(trainer.train_prompts[:8])
    shaped, advantages, _ = trainer.advantages(ro)
    ours = trainer.objective.choices
    trainer.objective.choices = Choices()  # ppo_lab's own choice at every decision
    shaped0, advantages0, _ = trainer.advantages(ro)
    trainer.objective.choices = ours
    real = ro.mask.bool()
    if choice == "score-past-last":
        assert not torch.allclose(shaped, shaped0)
        torch.testing.assert_close(shaped.sum(-1), shaped0.sum(-1))  # moved, not lost from the rewards
    if choice in ("gae-over-padding", "whiten-with-padding", "score-past-last"):
        assert (ro.mask.sum(-1) < ro.mask.shape[1]).any()  # some padding, or nothing could differ
        assert not torch.allclose(advantages[real], advantages0[real])


def test_the_decisions_table_asks_exactly_the_questions_of_decisions():
    """book/reference_decisions.md: one row per entry of `DECISIONS`, in order, its first column
    the entry's question verbatim."""
    page = (Path(__file__).resolve().parents[1] / "book" / "reference_decisions.md").read_text()
    questions = re.findall(r"^\| ([^|]+?) \|", page, flags=re.M)
    assert questions[0] == "question" and questions[1:] == [d.question for d in DECISIONS]
