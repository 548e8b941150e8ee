"""The KL-regularised optimum, the DPO loss and its trainer, and Bradley-Terry labels (chapter 8),
each against a slow, obviously correct reference."""

import math

import pytest
import torch

from ppo_lab.dpo import dpo_loss, encode_preferences, kl_regularised_objective, optimal_policy, sequence_logprobs, train_dpo
from ppo_lab.reward_model import PreferencePair, bradley_terry_labels, sampled_preference_pairs


def _objective(logp, ref_logp, rewards, beta):
    p = [math.exp(x) for x in logp]
    return sum(pi * r for pi, r in zip(p, rewards)) - beta * sum(pi * (lp - lr) for pi, lp, lr in zip(p, logp, ref_logp))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beta", [0.05, 0.5, 3.0])
def test_optimal_policy_is_the_closed_form_and_beats_every_other_policy(seed, beta):
    g = torch.Generator().manual_seed(seed)
    ref = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    r = torch.randn(6, generator=g, dtype=torch.float64)
    got = optimal_policy(ref, r, beta)
    weights = [math.exp(a) * math.exp(b / beta) for a, b in zip(ref.tolist(), r.tolist())]
    want = [math.log(w / sum(weights)) for w in weights]
    assert got.tolist() == pytest.approx(want, abs=1e-10)
    best = _objective(got.tolist(), ref.tolist(), r.tolist(), beta)
    # the objective as a function, against the loop; its maximum is beta log Z, and every policy
    # falls short of it by exactly beta KL(pi || pi*)
    assert kl_regularised_objective(got, ref, r, beta).item() == pytest.approx(best, abs=1e-10)
    assert best == pytest.approx(beta * torch.logsumexp(ref + r / beta, 0).item(), abs=1e-10)
    other = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    kl_to_best = (other.exp() * (other - got)).sum().item()
    assert kl_regularised_objective(other, ref, r, beta).item() == pytest.approx(best - beta * kl_to_best, abs=1e-10)
    assert kl_regularised_objective(other, ref, r, beta).item() == pytest.approx(_objective(other.tolist(), ref.tolist(), r.tolist(), beta), abs=1e-10)
    for _ in range(200):  # random policies, and small perturbations of the optimum
        other = torch.log_softmax(got + 0.3 * torch.randn(6, generator=g, dtype=torch.float64), 0)
        assert _objective(other.tolist(), ref.tolist(), r.tolist(), beta) <= best + 1e-12
        rand = torch.log_softmax(3 * torch.randn(6, generator=g, dtype=torch.float64), 0)
        assert _objective(rand.tolist(), ref.tolist(), r.tolist(), beta) <= best + 1e-12


def _slow_dpo(c, r, rc, rr, beta, eps):
    total, acc = 0.0, 0
    for a, b, x, y in zip(c, r, rc, rr):
        m = beta * ((a - x) - (b - y))
        total += -(1 - eps) * math.log(1 / (1 + math.exp(-m))) - eps * math.log(1 / (1 + math.exp(m)))
        acc += m > 0
    return total / len(c), acc / len(c)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_dpo_loss_against_the_formula(seed, eps):
    g = torch.Generator().manual_seed(seed)
    c, r, rc, rr = (-5 * torch.rand(7, generator=g, dtype=torch.float64) for _ in range(4))
    loss, m = dpo_loss(c, r, rc, rr, beta=0.3, label_smoothing=eps)
    want, acc = _slow_dpo(c.tolist(), r.tolist(), rc.tolist(), rr.tolist(), 0.3, eps)
    assert loss.item() == pytest.approx(want, rel=1e-10)
    assert m["dpo/reward_accuracy"].item() == pytest.approx(acc)
    assert m["dpo/margin"].item() == pytest.approx(float((0.3 * ((c - rc) - (r - rr))).mean()), rel=1e-10)


def test_dpo_loss_starts_at_log_2_and_pushes_the_chosen_up():
    c = torch.tensor([-3.0, -7.0], requires_grad=True)
    r = torch.tensor([-4.0, -2.0], requires_grad=True)
    loss, _ = dpo_loss(c, r, c.detach(), r.detach(), beta=0.5)  # the policy is the reference
    assert loss.item() == pytest.approx(math.log(2))
    loss.backward()
    assert (c.grad < 0).all() and (r.grad > 0).all()  # descent raises the chosen, lowers the rejected
    big, _ = dpo_loss(torch.tensor([500.0]), torch.tensor([-500.0]), torch.zeros(1), torch.zeros(1), beta=1.0)
    assert math.isfinite(big.item())
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(c, r, c, r, beta=0.0)
    with pytest.raises(ValueError, match=r"`rejected_logps` has shape \(1,\)"):
        dpo_loss(c, r[:1], c, r, beta=1.0)


def test_bradley_terry_labels_have_the_model_frequencies():
    g = torch.Generator().manual_seed(0)
    a, b = torch.tensor([1.0, 0.0, -0.5]).repeat(20000), torch.tensor([0.0, 0.0, 0.5]).repeat(20000)
    wins, p = bradley_terry_labels(a, b, scale=0.5, generator=g)
    for k, want in enumerate([1 / (1 + math.exp(-2.0)), 0.5, 1 / (1 + math.exp(2.0))]):
        freq = wins[k::3].double().mean().item()
        assert p[k].item() == pytest.approx(want)
        assert abs(freq - want) < 4 * math.sqrt(want * (1 - want) / 20000)
    with pytest.raises(ValueError, match="scale"):
        bradley_terry_labels(a, b, scale=0.0)


def test_sequence_logprobs_sum_the_token_logprobs(tiny_path):
    from ppo_lab.models import load_policy, load_tokenizer
    from ppo_lab.sampling import Sampling, generate

    tok, lm = load_tokenizer("builtin:tiny"), load_policy("builtin:tiny")
    s = generate(lm, tok, ["the movie was", "it is"], Sampling(max_new_tokens=8, temperature=0.8, stop_ids=(tok.eos_token_id,)), with_logprobs=True)
    got = sequence_logprobs(lm, s.query_ids, s.query_mask, s.response_ids, s.mask, temperature=0.8)
    assert torch.allclose(got, (s.sampler_logprobs * s.mask).sum(1), atol=1e-5)


def test_sampled_pairs_and_dpo_on_the_tiny_policy(tiny_path):
    """Pairs the tiny policy samples, labelled by a noisy Bradley-Terry labeller on VADER; DPO
    on them moves the implicit reward margin up and leaves the reference alone."""
    from ppo_lab.models import load_policy, load_tokenizer
    from ppo_lab.tasks import SentimentTask

    task = SentimentTask()
    tok, lm = load_tokenizer("builtin:tiny"), load_policy("builtin:tiny")
    pairs = sampled_preference_pairs(lm, tok, task.train_prompts, task.reward, 64, seed=0, scale=0.2)
    assert len(pairs) == 64 and all(0.0 < p.p_chosen < 1.0 for p in pairs)
    assert sum(p.p_chosen > 0.5 for p in pairs) > 32  # most labels agree with the gold reward
    q, qm, r, m = encode_preferences(tok, pairs[:2])
    assert q.shape[0] == 4 and (r[torch.arange(4), m.sum(1).long() - 1] == tok.eos_token_id).all()
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    history = train_dpo(lm, tok, pairs, beta=0.5, epochs=4, batch_size=16, lr=1e-3)
    assert history[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)  # the first step starts at the reference
    assert sum(h["dpo/margin"] for h in history[-4:]) / 4 > 0.5
    assert any(not torch.equal(v, before[k]) for k, v in lm.state_dict().items())
    with pytest.raises(ValueError, match="no preference pairs"):
        train_dpo(lm, tok, [])
    with pytest.raises(ValueError, match="empty prompt or response"):
        encode_preferences(tok, [PreferencePair("", "good .", "bad .")])


def test_reward_and_kl_against_a_row_by_row_reference(tiny_path):
    """reward_and_kl's KL is the mean of log pi(y|x) - log pi_ref(y|x) over the sampled
    responses, each computed here alone with a full forward and a log_softmax; the reward is the
    reward's mean on the decoded texts; the reference measured against itself has KL 0."""
    from ppo_lab.dpo import reward_and_kl
    from ppo_lab.models import load_policy, load_tokenizer
    from ppo_lab.sampling import Sampling, generate

    tok, ref = load_tokenizer("builtin:tiny"), load_policy("builtin:tiny")
    lm = load_policy("builtin:tiny")
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    prompts = ["the movie was", "it is", "the food"]
    length = lambda ps, rs: [float(len(r.split())) for r in rs]  # noqa: E731
    got = reward_and_kl(lm, ref, tok, prompts, length, n=6, max_new_tokens=5, temperature=0.7, seed=4)
    assert reward_and_kl(ref, ref, tok, prompts, length, n=6, max_new_tokens=5, seed=4)["kl"] == 0.0
    # the same draws, by hand
    g = torch.Generator().manual_seed(4)
    drawn = [prompts[i] for i in torch.randint(3, (6,), generator=g).tolist()]
    s = generate(lm, tok, drawn, Sampling(max_new_tokens=5, temperature=0.7, stop_ids=(tok.eos_token_id,)), uniforms=torch.rand(6, 5, generator=g))
    texts = tok.batch_decode(s.response_ids, skip_special_tokens=True)
    kls = []
    for i in range(6):
        q = s.query_ids[i][s.query_mask[i].bool()].tolist()
        r = s.response_ids[i][s.mask[i].bool()].tolist()
        ids = torch.tensor([q + r])
        total = 0.0
        for model, sign in ((lm, 1.0), (ref, -1.0)):
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].double() / 0.7, -1)
            total += sign * sum(logp[len(q) - 1 + t, tok_id].item() for t, tok_id in enumerate(r))
        kls.append(total)
    assert got["kl"] == pytest.approx(sum(kls) / 6, abs=1e-4)
    assert got["kl_se"] == pytest.approx(torch.tensor(kls).std().item() / math.sqrt(6), abs=1e-4)
    assert got["reward"] == pytest.approx(sum(len(t.split()) for t in texts) / 6)
    assert got["length"] == pytest.approx(s.mask.sum().item() / 6)
    # a model left in train mode with dropout on is measured in eval mode, and left in train mode
    drops = [m for m in lm.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops
    for m in drops:
        m.p = 0.5
    lm.train()
    again = reward_and_kl(lm, ref, tok, prompts, length, n=6, max_new_tokens=5, temperature=0.7, seed=4)
    assert again == pytest.approx(got) and lm.training and not ref.training
    with pytest.raises(ValueError, match="n = 1"):
        reward_and_kl(lm, ref, tok, prompts, length, n=1)
