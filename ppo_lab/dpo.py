"""The policy the KL-regularised objective asks for, and DPO, which fits it from preferences.

Chapter 8 (Reward models) derives both. For one prompt x, the objective PPO maximises,

    J(pi) = E_{y ~ pi}[ r(x, y) ] - beta * KL( pi(.|x) || pi_ref(.|x) ),

has the maximiser

    pi*(y|x) = pi_ref(y|x) * exp(r(x, y) / beta) / Z(x),    Z(x) = sum_y pi_ref(y|x) exp(r(x, y) / beta)

(`optimal_policy` computes it where the responses can be enumerated). Solved for r,
r(x, y) = beta * log(pi*(y|x) / pi_ref(y|x)) + beta * log Z(x); put into the Bradley-Terry
likelihood of a preference y_w > y_l, the log Z(x) cancels, and a policy can be fitted to the
preferences directly (Rafailov et al., 2023):

    L_DPO = -E[ log sigmoid( beta * (log pi(y_w|x)/pi_ref(y_w|x) - log pi(y_l|x)/pi_ref(y_l|x)) ) ]

`dpo_loss` is that loss on sequence log-probs (the reference's are inputs, computed once);
`sequence_logprobs` sums a model's token log-probs over a response; `train_dpo` fits a causal
LM to `PreferencePair`s with them.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from ._checks import check_float, check_range, check_same_shape, check_tensor


def optimal_policy(ref_logprobs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """log pi*(y) of the KL-regularised optimum over an enumerable set of responses.

    Args:
        ref_logprobs: (..., K) log pi_ref(y) of K responses (over the last dimension; they need
            not sum to 1 over K when K is a subset, the result is normalised over the K given).
        rewards: (..., K) r(y).
        beta: the KL coefficient, > 0.

    Returns:
        (..., K) log pi*(y) = log_softmax(ref_logprobs + rewards / beta).

    Example: ref [log 0.5, log 0.5], rewards [1, 0], beta 1 -> probabilities [e/(e+1), 1/(e+1)].
    """
    check_same_shape(ref_logprobs=ref_logprobs, rewards=rewards)
    check_float(ref_logprobs=ref_logprobs, rewards=rewards)
    beta = check_range("beta", beta, low=0.0, low_open=True)
    return torch.log_softmax(ref_logprobs + rewards / beta, dim=-1)


def kl_regularised_objective(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """J(pi) = E_pi[r] - beta * KL(pi || pi_ref), exactly, where the responses can be enumerated.

    Args:
        logprobs: (..., K) log pi(y) of K responses (a distribution over the last dimension).
        ref_logprobs: (..., K) log pi_ref(y).
        rewards: (..., K) r(y).
        beta: the KL coefficient, > 0.

    Returns:
        (...,) sum_y pi(y) * (r(y) - beta * (log pi(y) - log pi_ref(y))). Its maximum over pi is
        beta * logsumexp(ref_logprobs + rewards / beta), reached at `optimal_policy`.
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, rewards=rewards)
    check_float(logprobs=logprobs, ref_logprobs=ref_logprobs, rewards=rewards)
    beta = check_range("beta", beta, low=0.0, low_open=True)
    return (logprobs.exp() * (rewards - beta * (logprobs - ref_logprobs))).sum(dim=-1)


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict]:
    """The DPO loss of N preference pairs, from sequence log-probs.

    Args:
        chosen_logps, rejected_logps: (N,) log pi(y_w|x), log pi(y_l|x) under the policy (with
            gradients).
        ref_chosen_logps, ref_rejected_logps: (N,) the same under the frozen reference.
        beta: the KL coefficient of the objective DPO solves, > 0.
        label_smoothing: eps in [0, 0.5): the labels are taken as flipped with probability eps
            (the "conservative DPO" of Mitchell, 2023); 0 is the paper's loss.

    Returns:
        loss: 0-dim, mean over pairs of -(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m),
            m the difference of the chosen and rejected log-ratios (computed with softplus,
            finite for any margin).
        metrics: "dpo/reward_accuracy" (share with a positive margin), "dpo/margin" (mean
            beta * m), "dpo/chosen_reward" and "dpo/rejected_reward" (mean beta * log-ratio, the
            implicit rewards), detached.
    """
    for name, t in (("chosen_logps", chosen_logps), ("rejected_logps", rejected_logps), ("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
        check_tensor(name, t, ndim=1)
    check_same_shape(chosen_logps=chosen_logps, rejected_logps=rejected_logps, ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    check_float(chosen_logps=chosen_logps, rejected_logps=rejected_logps, ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    beta = check_range("beta", beta, low=0.0, low_open=True)
    eps = check_range("label_smoothing", label_smoothing, low=0.0, high=0.5, high_open=True)
    chosen = beta * (chosen_logps - ref_chosen_logps)
    rejected = beta * (rejected_logps - ref_rejected_logps)
    margin = chosen - rejected
    loss = ((1.0 - eps) * F.softplus(-margin) + eps * F.softplus(margin)).mean()
    with torch.no_grad():
        metrics = {
            "dpo/reward_accuracy": (margin > 0).float().mean(),
            "dpo/margin": margin.mean(),
            "dpo/chosen_reward": chosen.mean(),
            "dpo/rejected_reward": rejected.mean(),
        }
    return loss, metrics


def sequence_logprobs(model, query_ids, query_mask, response_ids, mask, temperature: float = 1.0) -> torch.Tensor:
    """(B,) log pi(response | prompt): the token log-probs summed over the real response tokens.

    Args: a (B, P) left-padded prompt and its mask, a (B, T) right-padded response and its
    mask (EOS included), as `ppo_lab.generate` returns them; `temperature` as in sampling.
    """
    from .logprobs import logprobs_from_logits
    from .rollout import response_logits

    logits, _ = response_logits(model, query_ids, query_mask, response_ids, mask)
    return (logprobs_from_logits(logits, response_ids, temperature) * mask).sum(dim=1)


def encode_preferences(tokenizer, pairs, end_with_eos: bool = True):
    """(query_ids, query_mask, response_ids, mask), the chosen responses' rows first and then the
    rejected ones (2N rows): prompts left-padded without special tokens, as generation sees
    them, responses right-padded with the EOS appended (they are complete texts)."""
    prompts = [p.prompt for p in pairs] * 2
    responses = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    enc = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    rows = [tokenizer(" " + r if not r[:1].isspace() else r, add_special_tokens=False)["input_ids"] for r in responses]
    if end_with_eos:
        rows = [row + [tokenizer.eos_token_id] for row in rows]
    if any(not q for q in enc) or any(not r for r in rows):
        raise ValueError("a preference pair has an empty prompt or response after tokenization")
    p, t = max(map(len, enc)), max(map(len, rows))
    query_ids = torch.full((len(enc), p), tokenizer.pad_token_id, dtype=torch.long)
    query_mask = torch.zeros((len(enc), p), dtype=torch.long)
    response_ids = torch.full((len(rows), t), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.float32)
    for i, (q, r) in enumerate(zip(enc, rows)):
        query_ids[i, p - len(q) :], query_mask[i, p - len(q) :] = torch.tensor(q), 1
        response_ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1.0
    return query_ids, query_mask, response_ids, mask


def train_dpo(model, tokenizer, pairs, *, beta: float = 0.1, epochs: int = 1, batch_size: int = 32, lr: float = 1e-4, seed: int = 0, temperature: float = 1.0) -> list[dict]:
    """Fit `model` (a causal LM, trained in place) to `pairs` with `dpo_loss`, the reference
    being a frozen copy of `model` as given. One AdamW step per batch of pairs, `epochs` passes
    in shuffled order. Returns one metrics dict per step (the loss and `dpo_loss`'s metrics)."""
    from .models import disable_dropout, make_reference

    if not pairs:
        raise ValueError("no preference pairs to train on")
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs = {epochs} and batch_size = {batch_size} must both be >= 1")
    torch.manual_seed(seed)
    disable_dropout(model)
    reference = make_reference(model)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    rng = random.Random(seed)
    history = []
    for _ in range(epochs):
        order = list(range(len(pairs)))
        rng.shuffle(order)
        for i in range(0, len(order), batch_size):
            batch = [pairs[j] for j in order[i : i + batch_size]]
            q, qm, r, m = (x.to(device) for x in encode_preferences(tokenizer, batch))
            n = len(batch)
            with torch.no_grad():
                ref = sequence_logprobs(reference, q, qm, r, m, temperature)
            model.train()
            logps = sequence_logprobs(model, q, qm, r, m, temperature)
            loss, metrics = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], beta)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            history.append({"dpo/loss": loss.item(), **{k: v.item() for k, v in metrics.items()}})
    model.eval()
    if not all(math.isfinite(h["dpo/loss"]) for h in history):
        raise FloatingPointError("the DPO loss became nan or inf")
    return history


@torch.no_grad()
def reward_and_kl(model, reference, tokenizer, prompts: list[str], reward_fn, *, n: int = 256, max_new_tokens: int = 12, temperature: float = 1.0, seed: int = 0) -> dict:
    """The two terms of the KL-regularised objective for `model`, estimated from n responses it
    samples to prompts drawn at random from `prompts` (EOS ends a response):

        reward = mean r(x, y),   kl = mean over responses of log pi(y|x) - log pi_ref(y|x)

    (the summed per-token k1, an unbiased estimate of KL(pi || pi_ref) per prompt), each with its
    standard error. Any two policies measured with the same `seed` answer the same prompts, so a
    DPO policy and a PPO policy are compared on one footing. Returns {"reward", "reward_se",
    "kl", "kl_se", "length"} (length: mean response tokens, EOS included)."""
    from .rewards import check_scores
    from .sampling import Sampling, generate

    if n < 2:
        raise ValueError(f"n = {n} must be >= 2 (a standard error needs two responses)")
    g = torch.Generator().manual_seed(seed)
    drawn_prompts = [prompts[i] for i in torch.randint(len(prompts), (n,), generator=g).tolist()]
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=(tokenizer.eos_token_id,))
    # Measured in eval mode: dropout left on would make both log-probs noisy (chapter 5); the
    # callers' modes are put back afterwards.
    modes = [(m, m.training) for m in (model, reference)]
    try:
        for m, _ in modes:
            m.eval()
        drawn = generate(model, tokenizer, drawn_prompts, sampling, uniforms=torch.rand(n, max_new_tokens, generator=g))
        rows = (drawn.query_ids, drawn.query_mask, drawn.response_ids, drawn.mask)
        kl = (sequence_logprobs(model, *rows, temperature) - sequence_logprobs(reference, *rows, temperature)).double().cpu()
    finally:
        for m, training in modes:
            m.train(training)
    texts = tokenizer.batch_decode(drawn.response_ids, skip_special_tokens=True)
    r = check_scores(reward_fn(drawn_prompts, texts), n, "reward_fn").double()
    se = lambda x: (x.std() / math.sqrt(len(x))).item()  # noqa: E731
    return {"reward": r.mean().item(), "reward_se": se(r), "kl": kl.mean().item(), "kl_se": se(kl), "length": drawn.mask.sum(1).double().mean().item()}
