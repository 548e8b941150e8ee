"""Hidden checks of assignment 'logprobs'."""

import torch
from _grading import expect, close, graded, lab
from test_logprobs_public import slow_logprobs


@graded("logprobs_from_logits", 1)
def test_half_precision_logits_give_float32_logprobs():
    """bfloat16 logits give float32 log-probabilities, computed without bfloat16 round-off"""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 6, 50, generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 6), generator=g)
    out = lab().logprobs_from_logits(logits, ids)
    expect(out.dtype == torch.float32, f"bfloat16 logits should give float32 log-probs (bf16 has 8 bits of mantissa, "
           f"about 1e-2 nats of error, the size of a whole PPO step); got {out.dtype}")
    close(out, slow_logprobs(logits.float(), ids, 1.0), "log-probabilities of bfloat16 logits", atol=1e-4)


@graded("logprobs_from_logits", 1)
def test_large_logits_do_not_overflow():
    """large logits (in the thousands) give finite, correct log-probabilities"""
    logits = torch.tensor([[[3000.0, 2990.0, -50.0]]])
    out = lab().logprobs_from_logits(logits, torch.tensor([[1]]))
    expect(bool(torch.isfinite(out).all()), f"logits near 3000 gave {out.tolist()}: exp() overflowed; subtract the maximum (logsumexp)")
    close(out, slow_logprobs(logits, torch.tensor([[1]]), 1.0), "log-probability with large logits")


@graded("response_mask", 2)
def test_pad_equal_to_eos():
    """when the padding is the EOS token itself (pad == eos), the EOS tokens after the first are padding"""
    out = lab().response_mask(torch.tensor([[5, 7, 2, 2, 2], [5, 7, 9, 4, 2], [2, 2, 2, 2, 2]]), 2)
    after = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1]]).bool()
    before = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]]).bool()
    expect(bool((out[after] == 0).all()) and bool((out[before] == 1).all()),
           f"with pad == eos == 2 (GPT-2 pads with its EOS): rows [[5, 7, 2, 2, 2], [5, 7, 9, 4, 2], [2, 2, 2, 2, 2]] gave "
           f"{out.int().tolist()}; the tokens before the first EOS are real and every token after it is padding, "
           "even though it is an EOS token too: only the first one ends the response")


@graded("response_mask", 1)
def test_several_stop_tokens():
    """a list of stop ids: the first of any of them ends the response"""
    out = lab().response_mask(torch.tensor([[5, 3, 7, 2], [5, 7, 2, 3]]), [2, 3])
    want = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]).float()
    expect(torch.equal(out.float(), want), f"stop ids [2, 3]: expected {want.int().tolist()}, got {out.int().tolist()}")


@graded("response_mask", 1)
def test_a_stop_token_before_stop_after_is_ordinary():
    """stop_after = k: a stop token at a position before k is an ordinary token"""
    out = lab().response_mask(torch.tensor([[2, 5, 2, 7, 2]]), 2, stop_after=2)
    want = torch.tensor([[1, 1, 1, 0, 0]]).float()
    expect(torch.equal(out.float(), want), f"ids [2, 5, 2, 7, 2], eos 2, stop_after 2: expected {want.int().tolist()}, got {out.int().tolist()} "
           "(the EOS at position 0 comes before stop_after and does not count)")
