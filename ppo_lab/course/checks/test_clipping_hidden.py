"""Hidden checks of assignment 'clipping'."""

import torch
from _grading import close, expect, graded, lab, right_padded
from test_clipping_public import policy_case


@graded("clipped_policy_loss", 1)
def test_padding_changes_nothing():
    """log-probs stored at padded positions (even huge ones) change neither the loss nor its gradient"""
    g = torch.Generator().manual_seed(3)
    mask = right_padded([4, 2], 4)
    lp, adv = torch.randn(2, 4, generator=g) * 0.05, torch.randn(2, 4, generator=g)
    junk = torch.where(mask > 0, lp, torch.full_like(lp, 500.0))
    a, b = lp.clone().requires_grad_(True), junk.clone().requires_grad_(True)
    la, _ = lab().clipped_policy_loss(a, torch.zeros(2, 4), adv, mask, 0.2)
    lb, _ = lab().clipped_policy_loss(b, torch.zeros(2, 4), adv, mask, 0.2)
    expect(bool(torch.isfinite(lb)), f"a log-prob of 500 at a padded position made the loss {float(lb)}: exp(500) overflows; "
           "give padded positions a log-ratio of 0 before exp()")
    la.backward(), lb.backward()
    close(lb, la, "the loss with junk at padded positions")
    close(b.grad * mask, a.grad * mask, "the gradient with junk at padded positions")


@graded("clipped_policy_loss", 1)
def test_clip_eps_high_sets_the_upper_end():
    """clip_eps_high sets the upper end of the range: ratio 1.25 with eps 0.2 and eps_high 0.28 is not clipped"""
    loss, grad = policy_case(1.25, 1.0, eps=0.2, eps_high=0.28)
    expect(abs(loss + 1.25) < 1e-5 and abs(grad + 1.25) < 1e-5,
           f"ratio 1.25, advantage +1, range [0.8, 1.28]: expected loss -1.25 and gradient -1.25, got {loss:.4f} and {grad:.4f}")


@graded("clipped_value_loss", 1)
def test_value_padding_changes_nothing():
    """values stored at padded positions do not change the value loss"""
    mask = right_padded([3, 1], 3)
    ret, old = torch.zeros(2, 3), torch.zeros(2, 3)
    v = torch.tensor([[0.5, -0.5, 1.0], [2.0, 7.0, 9.0]])
    clean = torch.where(mask > 0, v, torch.zeros_like(v))
    la, _ = lab().clipped_value_loss(clean, old, ret, mask, 0.2)
    lb, _ = lab().clipped_value_loss(v, old, ret, mask, 0.2)
    close(lb, la, "the value loss with other values at padded positions (it averages over the real tokens)")
