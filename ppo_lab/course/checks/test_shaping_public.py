"""Public checks of assignment 'shaping': per-token rewards, the score and the KL penalty (chapter 5).

The checks of `shape_rewards` give it a correct `last_real_index` (the `reference_last` fixture of
conftest.py), so that a mistake in one function costs the marks of that function only.
"""

import torch
from _grading import close, expect, graded, lab, right_padded


@graded("last_real_index", 2)
def test_last_real_index():
    """the index of each row's last real token (the last position where the mask is 1)"""
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 0, 1, 0]]).float()
    out = lab().last_real_index(mask)
    expect(torch.as_tensor(out).tolist() == [3, 0, 2, 2], f"mask {mask.int().tolist()}: expected [3, 0, 2, 2], got {torch.as_tensor(out).tolist()}")


@graded("shape_rewards", 2)
def test_every_real_token_pays_the_kl_penalty(reference_last):
    """every real token gets -kl_coef * (logprob - ref_logprob), the k1 estimate of its KL"""
    g = torch.Generator().manual_seed(0)
    mask = right_padded([4, 2], 5)
    lp, ref = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    out = lab().shape_rewards(torch.zeros(2), lp, ref, mask, kl_coef=0.3)
    close(out * mask, -0.3 * (lp - ref) * mask, "rewards of the real tokens with score 0 (the KL penalty alone)")


@graded("shape_rewards", 3)
def test_the_score_sits_on_the_last_real_token(reference_last):
    """the score sits on each response's last real token (its EOS, also when pad == eos)"""
    scores = torch.tensor([1.5, -2.0, 0.7])
    mask = right_padded([3, 4, 1], 5)
    out = lab().shape_rewards(scores, torch.zeros(3, 5), torch.zeros(3, 5), mask, kl_coef=0.0)
    for b, last in enumerate([2, 3, 0]):
        got = [t for t in range(5) if abs(float(out[b, t])) > 1e-6]
        expect(got == [last] and abs(float(out[b, last]) - float(scores[b])) < 1e-6,
               f"row {b} (mask {mask[b].int().tolist()}): its score {float(scores[b])} should sit on position {last}, "
               f"its last real token, and nowhere else; the rewards are {[round(float(x), 4) for x in out[b]]}")
    # pad == eos: the mask from response_mask keeps the first EOS, and the score goes there
    ids = torch.tensor([[5, 7, 2, 2, 2]])
    m = lab().response_mask(ids, 2)
    out = lab().shape_rewards(torch.tensor([1.0]), torch.zeros(1, 5), torch.zeros(1, 5), m, kl_coef=0.0)
    expect(abs(float(out[0, 2]) - 1.0) < 1e-6 and float(out[0].abs().sum()) < 1 + 1e-6,
           f"tokens {ids[0].tolist()} with pad == eos == 2: the score 1.0 should sit on position 2, the EOS; "
           f"the rewards are {out[0].tolist()}")
    # a response that used the whole budget: its last real token is the last position
    try:
        out = lab().shape_rewards(torch.tensor([1.0]), torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), kl_coef=0.0)
    except IndexError as err:
        expect(False, f"a response that fills all 3 positions raised IndexError ({err}): its score belongs on position 2, "
               "its last real token, not one past it")
    expect(out[0].tolist() == [0.0, 0.0, 1.0], f"a response that fills all 3 positions: expected rewards [0, 0, 1], got {out[0].tolist()}")
