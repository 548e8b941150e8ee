"""Public checks of assignment 'grpo': critic-free group baselines, RLOO and GRPO (chapter 10)."""

import torch
from _grading import close, expect, graded, lab, right_padded


def outcome(scores, lengths):
    """Per-token rewards holding each response's score on its last real token, and the mask."""
    mask = right_padded(lengths, max(lengths))
    rewards = torch.zeros(mask.shape)
    rewards[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = torch.tensor(scores)
    return rewards, mask


SCORES, GROUPS = [1.0, 0.0, 0.0, 3.0, 2.0, 5.0, 4.0], [0, 0, 0, 1, 1, 1, 1]


def per_token(adv, rewards):
    """Expect the (B, T) advantages of the docstring, not one number per response."""
    expect(tuple(adv.shape) == tuple(rewards.shape), f"the advantages should have the rewards' shape {tuple(rewards.shape)} "
           f"(one value per token, the response's advantage on each real token), got {tuple(adv.shape)}")
    return adv


def expect_broadcast(name):
    """Expect the estimator `name` to give each response one advantage on all its real tokens, 0 on padding."""
    rewards, mask = outcome([1.0, 2.0, 0.5, 4.0], [2, 4, 1, 3])
    adv = per_token(getattr(lab("estimators"), name)(rewards, mask, group_ids=torch.tensor([0, 0, 1, 1]))[0], rewards)
    expect(bool((adv[mask == 0] == 0).all()), f"padding should hold 0; advantages {adv.tolist()}")
    for b in range(4):
        real = adv[b][mask[b] > 0]
        expect(bool((real == real[0]).all()), f"row {b}: one advantage for the whole response expected, got {real.tolist()}")


@graded("rloo_estimator", 2)
def test_rloo_leaves_one_out():
    """each response's baseline is the mean score of the OTHER responses to its prompt"""
    rewards, mask = outcome(SCORES, [3] * 7)
    adv = per_token(lab("estimators").rloo_estimator(rewards, mask, group_ids=torch.tensor(GROUPS))[0], rewards)
    want = []
    for i, (s, g) in enumerate(zip(SCORES, GROUPS)):
        others = [SCORES[j] for j in range(7) if GROUPS[j] == g and j != i]
        want.append(s - sum(others) / len(others))
    close(adv[:, 0], torch.tensor(want), "RLOO advantages R_i - mean of the others in its group "
          "(a baseline that includes R_i itself is correlated with the sample and biases the gradient)")


@graded("rloo_estimator", 1)
def test_rloo_broadcasts_over_real_tokens():
    """each response's advantage is the same on all its real tokens, and 0 on padding"""
    expect_broadcast("rloo_estimator")


@graded("grpo_estimator", 2)
def test_grpo_group_mean_and_std():
    """GRPO's advantage is (R - group mean) / (group std + eps), with the unbiased std"""
    rewards, mask = outcome(SCORES, [2] * 7)
    adv = per_token(lab("estimators").grpo_estimator(rewards, mask, group_ids=torch.tensor(GROUPS), eps=1e-6)[0], rewards)
    want = []
    for s, g in zip(SCORES, GROUPS):
        group = torch.tensor([SCORES[j] for j in range(7) if GROUPS[j] == g], dtype=torch.float64)
        want.append((s - group.mean()) / (group.std(unbiased=True) + 1e-6))
    close(adv[:, 0], torch.tensor(want), "GRPO advantages (R_i - mean) / (std + eps), std with n - 1 as in torch.std")
