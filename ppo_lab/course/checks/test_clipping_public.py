"""Public checks of assignment 'clipping': PPO-clip's policy loss and the clipped value loss (chapter 6)."""

import torch
from _grading import close, expect, graded, lab


def policy_case(ratio, advantage, eps=0.2, eps_high=None):
    """Loss and d loss / d logprob of one token with the given ratio and advantage (B = T = 1)."""
    lp = torch.tensor([[float(torch.log(torch.tensor(ratio)))]], requires_grad=True)
    loss, _ = lab().clipped_policy_loss(lp, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), eps, eps_high)
    loss.backward()
    return float(loss), float(lp.grad)


def slow_policy_case(ratio, advantage, eps=0.2, eps_high=None):
    """The same by the case table: the loss is max(-rA, -clip(r)A); the gradient is -rA unless the clipped term is strictly larger."""
    hi = 1 + (eps if eps_high is None else eps_high)
    clipped = min(max(ratio, 1 - eps), hi)
    if -clipped * advantage > -ratio * advantage:
        return -clipped * advantage, 0.0
    return -ratio * advantage, -ratio * advantage


@graded("clipped_policy_loss", 2)
def test_inside_the_range_the_loss_is_the_surrogate():
    """inside the clip range the loss is -ratio * advantage, and so is its gradient in log-prob"""
    g = torch.Generator().manual_seed(0)
    lp, old = torch.randn(3, 4, generator=g) * 0.05, torch.zeros(3, 4)
    adv = torch.randn(3, 4, generator=g)
    lp.requires_grad_(True)
    loss, _ = lab().clipped_policy_loss(lp, old, adv, torch.ones(3, 4), 0.2)
    loss.backward()
    ratio = torch.exp(lp.detach())
    close(loss, (-ratio * adv).mean(), "the loss (mean over the tokens) with every ratio inside [0.8, 1.2]")
    close(lp.grad, -ratio * adv / 12, "the gradient with respect to the log-probs inside the clip range")


@graded("clipped_policy_loss", 3)
def test_outside_the_range_the_pessimistic_term_wins():
    """outside the range the loss is the larger (pessimistic) term; the gradient is cut in exactly the two clipped cases"""
    for ratio, adv in ((1.5, 1.0), (0.5, 1.0), (1.5, -1.0), (0.5, -1.0), (1.1, 1.0), (0.9, -1.0)):
        got, want = policy_case(ratio, adv), slow_policy_case(ratio, adv)
        cut = want[1] == 0.0
        expect(abs(got[0] - want[0]) < 1e-5 and abs(got[1] - want[1]) < 1e-5,
               f"ratio {ratio}, advantage {adv:+}: expected loss {want[0]:.4f} and gradient {want[1]:.4f} "
               f"({'clipped: no gradient' if cut else 'not clipped: the gradient of -ratio * A'}), got {got[0]:.4f} and {got[1]:.4f}. "
               "PPO minimises max(-rA, -clip(r)A): the pessimistic of the two")


@graded("clipped_value_loss", 2)
def test_value_loss_without_clipping():
    """without value_clip the loss is half the mean squared error"""
    g = torch.Generator().manual_seed(1)
    v, old, ret = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    loss, _ = lab().clipped_value_loss(v, old, ret, torch.ones(2, 5), None)
    close(loss, 0.5 * ((v - ret) ** 2).mean(), "value loss with value_clip=None")


@graded("clipped_value_loss", 2)
def test_value_loss_with_clipping():
    """with value_clip c, the larger of (V - R)^2 and (V_old + clip(V - V_old, -c, c) - R)^2, halved"""
    g = torch.Generator().manual_seed(2)
    v, old, ret = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    v.requires_grad_(True)
    loss, _ = lab().clipped_value_loss(v, old, ret, torch.ones(3, 4), 0.2)
    loss.backward()
    vd = v.detach()
    clipped = old + torch.clamp(vd - old, -0.2, 0.2)
    per = torch.maximum((vd - ret) ** 2, (clipped - ret) ** 2)
    close(loss, 0.5 * per.mean(), "clipped value loss (value_clip 0.2): the clip is around the OLD value, the max is pessimistic")
    grad = torch.where((clipped - ret) ** 2 > (vd - ret) ** 2, torch.zeros_like(vd), (vd - ret) / 12)
    close(v.grad, grad, "gradient of the clipped value loss (0 where the clipped error is the larger)")
