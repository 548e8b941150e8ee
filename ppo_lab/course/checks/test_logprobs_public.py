"""Public checks of assignment 'logprobs': log-probabilities and response masks (chapter 1)."""

import torch
from _grading import expect, close, graded, lab


def slow_logprobs(logits, ids, temperature):
    """log softmax(logits / tau) at the given ids, one position at a time, in float64."""
    out = torch.zeros(ids.shape, dtype=torch.float64)
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            z = logits[b, t].double() / temperature
            out[b, t] = z[ids[b, t]] - torch.log(torch.exp(z - z.max()).sum()) - z.max()
    return out


@graded("logprobs_from_logits", 2)
def test_logprobs_are_log_softmax_at_the_sampled_tokens():
    """log-probabilities are the log-softmax of the logits at the sampled tokens"""
    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(3, 5, 7, generator=g) * 2, torch.randint(0, 7, (3, 5), generator=g)
    out = lab().logprobs_from_logits(logits, ids)
    close(out, slow_logprobs(logits, ids, 1.0), "log-probabilities at temperature 1")


@graded("logprobs_from_logits", 2)
def test_the_temperature_divides_the_logits():
    """the temperature divides the logits before the softmax, as in sampling"""
    g = torch.Generator().manual_seed(1)
    logits, ids = torch.randn(2, 4, 6, generator=g) * 2, torch.randint(0, 6, (2, 4), generator=g)
    for tau in (0.7, 1.5):
        out = lab().logprobs_from_logits(logits, ids, temperature=tau)
        expect(not torch.allclose(out.double(), slow_logprobs(logits, ids, 1.0), atol=1e-4),
               f"at temperature {tau} the log-probabilities equal those at temperature 1: the temperature was ignored "
               "(the responses were sampled from softmax(logits / tau), so that is the policy whose log-probs enter the ratio)")
        close(out, slow_logprobs(logits, ids, tau), f"log-probabilities at temperature {tau}")
    half = lab().logprobs_from_logits(logits.to(torch.bfloat16), ids, temperature=0.7)
    close(half, slow_logprobs(logits.to(torch.bfloat16).float(), ids, 0.7), "log-probabilities of bfloat16 logits at temperature 0.7", atol=1e-3)


@graded("response_mask", 2)
def test_the_mask_ends_at_the_first_eos():
    """the mask covers each response up to and including its first EOS, whatever follows it"""
    eos = 2
    ids = torch.tensor([[5, 7, 2, 0, 0], [5, 2, 7, 3, 9], [2, 1, 1, 1, 1]])
    want = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]).float()
    out = lab().response_mask(ids, eos)
    expect(out.shape == want.shape, f"the mask should have the shape of the ids {tuple(want.shape)}, got {tuple(out.shape)}")
    for b in range(3):
        expect(torch.equal(out[b].float(), want[b]),
               f"row {ids[b].tolist()} with eos {eos}: expected mask {want[b].int().tolist()}, got {out[b].int().tolist()} "
               "(the EOS is a real token, where the score will go; everything after the first one is padding)")


@graded("response_mask", 1)
def test_a_response_without_eos_is_real_throughout():
    """a response that never stops (it used the whole budget) is real at every position"""
    out = lab().response_mask(torch.tensor([[5, 7, 9, 1]]), 2)
    expect(torch.equal(out.float(), torch.ones(1, 4)), f"expected [1, 1, 1, 1] for a response without EOS, got {out.int().tolist()}")
