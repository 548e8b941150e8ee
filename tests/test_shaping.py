import pytest
import torch

import reference as ref
from conftest import DTYPES, SEEDS, SHAPES, random_mask, scribble
from ppo_lab import KL_ESTIMATORS, kl_penalty, last_real_index, response_mask, shape_rewards


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KL_ESTIMATORS)
@pytest.mark.parametrize("score_clip", [None, 0.5])
def test_shape_rewards_matches_reference(seed, shape, dtype, kind, score_clip):
    g = torch.Generator().manual_seed(seed)
    B, T = shape
    scores = torch.randn(B, generator=g, dtype=torch.float64).to(dtype) * 2
    lp = (torch.randn(shape, generator=g, dtype=torch.float64) - 2).to(dtype)
    rlp = (torch.randn(shape, generator=g, dtype=torch.float64) - 2).to(dtype)
    mask = random_mask(B, T, g)
    got = shape_rewards(scores, lp, rlp, mask, 0.1, kind, score_clip)
    want = torch.tensor(ref.shape_rewards(scores, lp, rlp, mask, 0.1, kind, score_clip), dtype=torch.float64)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    # padding never holds a reward, and its log-probs cannot matter
    assert torch.all(got[mask == 0] == 0)
    dirty = shape_rewards(scores, scribble(lp, mask, g), scribble(rlp, mask, g), mask, 0.1, kind, score_clip)
    assert torch.equal(dirty, got)


def test_docstring_example():
    got = shape_rewards(
        torch.tensor([2.0]), torch.tensor([[0.1, 0.3, 9.9]]), torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]), 0.5
    )
    torch.testing.assert_close(got, torch.tensor([[-0.05, 1.85, 0.0]]))


def test_score_sits_on_the_last_real_token_for_every_length():
    """Lengths 1 (stopped at once), a middle length, and the full budget (no EOS)."""
    T = 5
    mask = torch.tensor([[1.0, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    scores = torch.tensor([3.0, 4.0, 5.0])
    zeros = torch.zeros(3, T)
    rewards = shape_rewards(scores, zeros, zeros, mask, kl_coef=0.2)
    assert last_real_index(mask).tolist() == [0, 2, 4]
    assert rewards.tolist() == [[3, 0, 0, 0, 0], [0, 0, 4, 0, 0], [0, 0, 0, 0, 5]]


def test_pad_equal_eos_puts_the_score_on_the_eos_token():
    """GPT-2 style: pad == eos. The score must land on the generated EOS, not one token early
    (AlpacaFarm's `(responses != pad).sum() - 1`) and not one past it (TRL's `sequence_lengths_p1`)."""
    eos = pad = 0
    responses = torch.tensor([[7, 8, eos, pad, pad], [7, eos, pad, pad, pad], [7, 8, 9, 6, 5]])
    mask = response_mask(responses, eos)
    scores = torch.tensor([1.0, 2.0, 3.0])
    zeros = torch.zeros(3, 5)
    rewards = shape_rewards(scores, zeros, zeros, mask, kl_coef=0.0)
    assert rewards.argmax(-1).tolist() == [2, 1, 4]  # the EOS positions, and the last token
    alpacafarm_position = (responses != pad).sum(-1) - 1
    assert alpacafarm_position.tolist() == [1, 0, 4]  # one early whenever an EOS was generated
    trl_position = torch.clamp(alpacafarm_position + 2, max=4)  # first pad + 1 past the last non-pad
    assert (rewards[torch.arange(3), trl_position] == 0).any()


def test_total_reward_is_score_minus_beta_times_kl(gen):
    lp = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    rlp = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    mask = random_mask(4, 7, gen)
    scores = torch.randn(4, generator=gen, dtype=torch.float64)
    r = shape_rewards(scores, lp, rlp, mask, 0.3)
    kl = (kl_penalty(lp, rlp, "k1") * mask).sum(-1)
    torch.testing.assert_close(r.sum(-1), scores - 0.3 * kl)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_scores_are_refused(bad):
    with pytest.raises(ValueError, match=r"scores.*nan or inf.*\[1\]"):
        shape_rewards(torch.tensor([1.0, bad]), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 0.1)


def test_wrong_number_of_scores_is_refused():
    with pytest.raises(ValueError, match=r"`scores` has 3 entries but the batch has 2"):
        shape_rewards(torch.zeros(3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 0.1)


def test_a_response_with_no_real_token_is_refused():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match=r"no real tokens along dim=-1 at index\(es\) \[1\]"):
        shape_rewards(torch.zeros(2), torch.zeros(2, 2), torch.zeros(2, 2), mask, 0.1)
