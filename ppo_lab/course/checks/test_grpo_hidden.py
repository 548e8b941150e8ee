"""Hidden checks of assignment 'grpo'."""

import torch
from _grading import close, expect, graded, lab
from test_grpo_public import GROUPS, SCORES, expect_broadcast, outcome, per_token


@graded("rloo_estimator", 1)
def test_rloo_groups_by_id_in_any_order():
    """groups are found by their ids, whatever the order of the rows"""
    rewards, mask = outcome(SCORES, [3] * 7)
    ids = torch.tensor(GROUPS)
    perm = torch.tensor([3, 0, 5, 1, 6, 2, 4])
    a, _ = lab("estimators").rloo_estimator(rewards, mask, group_ids=ids)
    b, _ = lab("estimators").rloo_estimator(rewards[perm], mask[perm], group_ids=ids[perm])
    close(b, a[perm], "RLOO advantages of the shuffled rows (each row's advantage must follow it)")


@graded("rloo_estimator", 1)
def test_rloo_advantages_of_a_group_sum_to_zero():
    """the advantages of each group sum to zero (R_i - mean of the others, summed over i, is 0)"""
    rewards, mask = outcome([1.0, 2.0, 6.0, 0.5, 4.0], [2] * 5)
    adv = per_token(lab("estimators").rloo_estimator(rewards, mask, group_ids=torch.tensor([0, 0, 0, 1, 1]))[0], rewards)
    sums = [float(adv[:3, 0].sum()), float(adv[3:, 0].sum())]
    expect(max(abs(x) for x in sums) < 1e-5, f"the groups' advantages sum to {sums}, not 0: the mean of the OTHER responses "
           "divides their sum by n - 1")


@graded("grpo_estimator", 1)
def test_grpo_without_the_std():
    """norm_by_std = False leaves the division out (Dr. GRPO)"""
    rewards, mask = outcome(SCORES, [2] * 7)
    adv = per_token(lab("estimators").grpo_estimator(rewards, mask, group_ids=torch.tensor(GROUPS), norm_by_std=False)[0], rewards)
    means = {0: 1 / 3, 1: 3.5}
    close(adv[:, 0], torch.tensor([s - means[g] for s, g in zip(SCORES, GROUPS)]), "advantages R_i - group mean without the std")


@graded("grpo_estimator", 1)
def test_grpo_broadcasts_over_real_tokens():
    """each response's advantage is the same on all its real tokens, and 0 on padding"""
    expect_broadcast("grpo_estimator")


@graded("grpo_estimator", 1)
def test_grpo_a_tied_group_gets_zero():
    """a group whose responses all score the same gets advantage 0 (not nan)"""
    rewards, mask = outcome([1.0, 1.0, 1.0, 0.0, 2.0], [2] * 5)
    adv = per_token(lab("estimators").grpo_estimator(rewards, mask, group_ids=torch.tensor([0, 0, 0, 1, 1]))[0], rewards)
    expect(bool(torch.isfinite(adv).all()) and bool((adv[:3] == 0).all()),
           f"a group scoring 1, 1, 1 has std 0: its advantages should be 0 (eps keeps the division finite); got {adv[:3, 0].tolist()}")
