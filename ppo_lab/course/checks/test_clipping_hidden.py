"""Hidden checks of assignment 'clipping'."""

import torch
from _grading import close, expect, graded, lab
from test_clipping_public import policy_case


def clipfrac(ratio, advantage, eps=0.2, eps_high=None):
    lp = torch.tensor([[float(torch.log(torch.tensor(ratio)))]])
    _, metrics = lab().clipped_policy_loss(lp, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), eps, eps_high)
    return float(metrics["policy/clipfrac"])


@graded("clipped_policy_loss", 1)
def test_the_clip_fraction_counts_the_cut_tokens():
    """policy/clipfrac counts exactly the tokens whose gradient is cut (the rest of the function reads your clipped and unclipped)"""
    for ratio, adv, cut in ((1.5, 1.0, 1), (0.5, -1.0, 1), (1.5, -1.0, 0), (0.5, 1.0, 0), (1.1, 1.0, 0), (0.9, -1.0, 0)):
        got = clipfrac(ratio, adv)
        expect(got == cut, f"ratio {ratio}, advantage {adv:+}: policy/clipfrac should be {cut}, got {got}. The metric is "
               "(clipped > unclipped), so `clipped` and `unclipped` must be the two per-token LOSSES, -clip(r) A and -r A")


@graded("clipped_policy_loss", 1)
def test_clip_eps_high_sets_the_upper_end_only():
    """clip_eps_high moves the upper end of the range only: [1 - eps, 1 + eps_high]"""
    loss, grad = policy_case(1.25, 1.0, eps=0.2, eps_high=0.28)
    expect(abs(loss + 1.25) < 1e-5 and abs(grad + 1.25) < 1e-5,
           f"ratio 1.25, advantage +1, range [0.8, 1.28]: expected loss -1.25 and gradient -1.25 (inside the range), got {loss:.4f} and {grad:.4f}")
    got = clipfrac(0.75, -1.0, eps=0.2, eps_high=0.28)
    expect(got == 1, f"ratio 0.75, advantage -1, eps 0.2, eps_high 0.28: 0.75 is below the lower end 0.8, so the token is clipped "
           f"(policy/clipfrac 1); got {got}: the lower end must stay 1 - clip_eps")


@graded("clipped_value_loss", 1)
def test_the_value_clip_fraction():
    """value/clipfrac is the share of real tokens whose gradient the clip cuts (0 without value_clip)"""
    v = torch.tensor([[0.5, 0.1, -0.5, 0.3, -0.05, 0.7]], requires_grad=True)
    old, ret = torch.zeros(1, 6), torch.tensor([[1.0, -0.4, 1.0, -1.0, 0.6, 0.2]])
    loss, metrics = lab().clipped_value_loss(v, old, ret, torch.ones(1, 6), 0.2)
    loss.backward()
    cut = (v.grad == 0).float().mean()  # no token sits exactly on its return, so a zero gradient means cut
    close(metrics["value/clipfrac"], cut, "value/clipfrac with value_clip 0.2: the share of tokens whose gradient is zero because "
          "the clipped error is the larger (the rest of the function reads your clipped_more)")
    _, metrics = lab().clipped_value_loss(v.detach(), old, ret, torch.ones(1, 6), None)
    close(metrics["value/clipfrac"], torch.tensor(0.0), "value/clipfrac with value_clip None")
