"""Hidden checks of assignment 'shaping'."""

import torch
from _grading import close, expect, graded, lab, right_padded


@graded("last_real_index", 1)
def test_last_real_index_is_an_integer_index():
    """it returns a (B,) integer tensor, usable to index the rewards"""
    out = lab().last_real_index(torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    expect(isinstance(out, torch.Tensor) and out.shape == (2,) and not out.is_floating_point(),
           f"expected a (2,) integer tensor, got {type(out).__name__} {getattr(out, 'dtype', '')} {tuple(getattr(out, 'shape', ()))}")


@graded("shape_rewards", 1)
def test_padding_gets_no_reward(reference_last):
    """padded positions get reward 0, whatever log-probs they hold"""
    g = torch.Generator().manual_seed(1)
    mask = right_padded([2, 3], 4)
    lp, ref = torch.randn(2, 4, generator=g) * 50, torch.randn(2, 4, generator=g) * 50
    out = lab().shape_rewards(torch.zeros(2), lp, ref, mask, kl_coef=0.1)
    expect(bool((out[mask == 0] == 0).all()), f"padded positions should get 0; the rewards are {out.tolist()} for mask {mask.int().tolist()}")


@graded("shape_rewards", 1)
def test_the_named_kl_estimator_is_used(reference_last):
    """kl_estimator = 'k3' penalises (r - 1) - log r with r = ref / policy"""
    g = torch.Generator().manual_seed(2)
    mask = right_padded([3, 2], 4)
    lp, ref = torch.randn(2, 4, generator=g) * 0.5, torch.randn(2, 4, generator=g) * 0.5
    out = lab().shape_rewards(torch.zeros(2), lp, ref, mask, kl_coef=0.2, kl_estimator="k3")
    log_r = ref - lp
    close(out * mask, -0.2 * (torch.expm1(log_r) - log_r) * mask, "rewards of the real tokens with the k3 estimator")


@graded("shape_rewards", 1)
def test_the_inputs_are_left_alone(reference_last):
    """the inputs (scores, log-probs, mask) are not modified in place"""
    g = torch.Generator().manual_seed(3)
    scores, lp, ref, mask = torch.randn(2, generator=g), torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g), right_padded([3, 2], 4)
    before = [x.clone() for x in (scores, lp, ref, mask)]
    lab().shape_rewards(scores, lp, ref, mask, kl_coef=0.5)
    for name, x, y in zip(("scores", "logprobs", "ref_logprobs", "mask"), (scores, lp, ref, mask), before):
        expect(torch.equal(x, y), f"shape_rewards changed its argument `{name}` in place; the trainer reads it again afterwards")
