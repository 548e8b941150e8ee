"""Reward models from preference pairs: the Bradley-Terry loss and a small trainer.

Chapter 8 (Reward models) derives and uses it. Given a prompt x and two responses, a labeller
prefers y_w over y_l. The Bradley-Terry model says P(y_w > y_l) = sigmoid(r(x, y_w) - r(x, y_l)),
so a reward model r is fitted by minimising

    L = -E[ log sigmoid(r(x, y_w) - r(x, y_l)) ]

(Ouyang et al. 2022, eq. 1). Only differences of rewards are identified: adding a constant to r
changes nothing, which is why RLHF pipelines often normalise the score afterwards.

`train_reward_model` fits a 1-label sequence classifier (by default initialised from the tiny
offline model), scored at the EOS token, and saves it with `save_pretrained`, so it plugs into
the trainer as `PPOConfig(reward="<folder>")` like any reward model from the hub.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ._checks import check_same_shape, check_tensor


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Negative log-likelihood of the preferences under the Bradley-Terry model.

    Args:
        chosen_scores: (N,) r(x, y_w) of the preferred responses.
        rejected_scores: (N,) r(x, y_l) of the other responses.

    Returns:
        loss: 0-dim, mean of -log sigmoid(chosen - rejected) (computed as softplus(-margin),
            which stays finite for large margins).
        metrics: "reward_model/accuracy" (share with chosen > rejected) and
            "reward_model/margin" (mean chosen - rejected), detached.
    """
    check_tensor("chosen_scores", chosen_scores, ndim=1)
    check_same_shape(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    margin = chosen_scores - rejected_scores
    loss = F.softplus(-margin).mean()
    with torch.no_grad():
        metrics = {"reward_model/accuracy": (margin > 0).float().mean(), "reward_model/margin": margin.mean()}
    return loss, metrics


def init_reward_head(head: torch.nn.Linear) -> torch.nn.Linear:
    """Weights from N(0, 1/sqrt(d + 1)) for d inputs, bias (if any) 0: the reward head of OpenAI
    (2019) and N+, which makes the first scores of order 1 whatever the hidden size."""
    torch.nn.init.normal_(head.weight, std=1.0 / math.sqrt(head.in_features + 1))
    if head.bias is not None:
        torch.nn.init.zeros_(head.bias)
    return head


def linear_to_zero(total_steps: int):
    """The learning-rate factor of step s = 0, 1, ..., total_steps - 1: 1 - s / total_steps, so
    the rate falls linearly from its full value toward 0 (the last step takes 1/total_steps of
    it), for `torch.optim.lr_scheduler.LambdaLR`."""
    if total_steps < 1:
        raise ValueError(f"total_steps = {total_steps} must be >= 1")
    return lambda step: max(0.0, 1.0 - step / total_steps)


@dataclass
class PreferencePair:
    """One labelled comparison: two responses to `prompt`, the preferred one first."""

    prompt: str
    chosen: str
    rejected: str
    p_chosen: float | None = None  # the labeller's probability of this label, when it is known


def bradley_terry_labels(scores_a: torch.Tensor, scores_b: torch.Tensor, scale: float = 1.0, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy labels the way a Bradley-Terry labeller gives them.

    Args:
        scores_a, scores_b: (N,) the true (gold) rewards of the two responses of each pair.
        scale: the labeller's noise: a prefers a with probability sigmoid((a - b) / scale);
            small scale, an almost perfect labeller; large, a coin.
        generator: the random draws (CPU).

    Returns:
        (a_preferred (N,) bool, p_a (N,) float: the probability each label had of being "a").
        The best accuracy any reward model can reach against such labels is mean(max(p_a, 1 - p_a)).
    """
    check_tensor("scores_a", scores_a, ndim=1)
    check_same_shape(scores_a=scores_a, scores_b=scores_b)
    if not scale > 0:
        raise ValueError(f"scale = {scale!r} must be > 0")
    p_a = torch.sigmoid((scores_a.double() - scores_b.double()) / scale)
    return torch.rand(p_a.shape, generator=generator, dtype=torch.float64) < p_a, p_a


@torch.no_grad()
def sampled_preference_pairs(model, tokenizer, prompts: list[str], reward_fn, n: int, *, seed: int = 0, scale: float = 1.0, max_new_tokens: int = 12, temperature: float = 1.0) -> list[PreferencePair]:
    """n pairs of two responses `model` samples for the same prompt (prompts drawn at random),
    labelled by `bradley_terry_labels` on `reward_fn`'s scores: the preference data of an RLHF
    run, with a known gold reward behind it. Only responses that ended with EOS are paired (a
    reward model and DPO read them as complete texts); each pair keeps its label's probability."""
    from .sampling import Sampling, generate

    g = torch.Generator().manual_seed(seed)
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=(tokenizer.eos_token_id,))
    pairs: list[PreferencePair] = []
    for _ in range(20):  # rounds of sampling until n pairs of complete responses
        need = n - len(pairs)
        if need <= 0:
            break
        drawn_prompts = [prompts[i] for i in torch.randint(len(prompts), (need,), generator=g).tolist()]
        doubled = [p for p in drawn_prompts for _ in range(2)]
        drawn = generate(model, tokenizer, doubled, sampling, uniforms=torch.rand(len(doubled), max_new_tokens, generator=g))
        texts = tokenizer.batch_decode(drawn.response_ids, skip_special_tokens=True)
        ok = [bool(drawn.ended[2 * i]) and bool(drawn.ended[2 * i + 1]) and texts[2 * i].strip() and texts[2 * i + 1].strip() for i in range(need)]
        keep = [i for i in range(need) if ok[i]]
        if not keep:
            continue
        gold = torch.as_tensor(reward_fn(doubled, texts), dtype=torch.float64)
        a_wins, p_a = bradley_terry_labels(gold[0::2][keep], gold[1::2][keep], scale, g)
        for j, i in enumerate(keep):
            a, b = texts[2 * i], texts[2 * i + 1]
            win, p = bool(a_wins[j]), float(p_a[j])
            pairs.append(PreferencePair(doubled[2 * i], a if win else b, b if win else a, p if win else 1.0 - p))
    if len(pairs) < n:
        raise ValueError(f"only {len(pairs)} of {n} pairs had two responses that ended with EOS in {max_new_tokens} tokens; raise max_new_tokens")
    return pairs[:n]


def preference_pairs(task, n: int, seed: int = 0, min_gap: float = 0.05) -> list[PreferencePair]:
    """Pairs of responses to the same prompt, labelled by the task's gold reward.

    The responses are the task's own pretraining text split after the prompt's words; the
    "labeller" prefers the one with the higher gold reward. Pairs whose gold rewards differ by
    less than `min_gap` are skipped (a labeller could not tell them apart).
    """
    rng = random.Random(seed)
    by_prompt: dict[str, list[str]] = {}
    for text in task.corpus(max(4 * n, 200), seed):
        for prompt in task.train_prompts + task.eval_prompts:
            if text.startswith(prompt + " "):
                by_prompt.setdefault(prompt, []).append(text[len(prompt) + 1 :])
    prompts = sorted(p for p, rs in by_prompt.items() if len(rs) >= 2)
    if not prompts:
        raise ValueError(f"task {task.name!r} gave no prompt with two responses to compare")
    pairs: list[PreferencePair] = []
    attempts = 0
    while len(pairs) < n and attempts < 50 * n:
        attempts += 1
        prompt = rng.choice(prompts)
        a, b = rng.sample(by_prompt[prompt], 2)
        ra, rb = task.reward([prompt, prompt], [a, b])
        if abs(ra - rb) < min_gap:
            continue
        pairs.append(PreferencePair(prompt, a, b) if ra > rb else PreferencePair(prompt, b, a))
    return pairs


def train_reward_model(
    pairs: list[PreferencePair],
    output_dir: str | Path,
    base: str = "builtin:tiny",
    epochs: int = 1,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    normalize_on: tuple[list[str], list[str]] | None = None,
    normalize: str = "mean-std",
) -> dict:
    """Fit a 1-label sequence classifier to `pairs` with the Bradley-Terry loss and save it.

    The recipe of OpenAI (2019) and N+ (Huang et al., 2024), each step of it on purpose:

    - the score is read at the EOS token appended to every response (`rewards.encode_pairs`,
      `rewards.sequence_scores`), the token `SequenceClassifierReward` reads it at later;
    - the new head is initialised from N(0, 1/sqrt(d + 1)) for a hidden size d, so the first
      scores are of order 1 whatever d is;
    - `epochs` passes (the recipes: one) over the pairs in shuffled batches, with the learning
      rate annealed linearly from `lr` to 0;
    - after training, if `normalize_on` = (prompts, responses) is given (the reference policy's
      responses, say), a gain and a bias are fitted so that those responses score mean 0 and
      std 1 ("mean-std") or mean 0 ("mean"); they are stored in the saved config as
      `reward_gain` and `reward_bias` and applied by `SequenceClassifierReward`. (Loaded with
      transformers alone, the head gives the raw score.) The responses count as ended.

    Returns the metrics of the last step (and the gain and bias). The folder holds the model and
    its tokenizer.
    """
    from transformers import AutoModelForSequenceClassification

    from .hf import quiet_transformers
    from .models import disable_dropout, load_pretrained, load_tokenizer
    from .rewards import encode_pairs, sequence_scores
    from .shaping import reference_normalization

    if not pairs:
        raise ValueError("no preference pairs to train on")
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs = {epochs} and batch_size = {batch_size} must both be >= 1")
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(base)
    model = load_pretrained(AutoModelForSequenceClassification, base, "reward model base", new_weights=True, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    from .rewards import reads_at_a_token

    if not reads_at_a_token(model):
        raise ValueError(f"train_reward_model needs a decoder base (a causal LM, which gets a `score` head); {base!r} loads as {type(model).__name__}")
    init_reward_head(model.score)  # always a new head, even if `base` is a reward model already
    disable_dropout(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    per_epoch = math.ceil(len(pairs) / batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_to_zero(epochs * per_epoch))
    rng = random.Random(seed)
    metrics: dict = {}
    for _ in range(epochs):
        order = list(range(len(pairs)))
        rng.shuffle(order)
        for i in range(0, len(order), batch_size):
            batch = [pairs[j] for j in order[i : i + batch_size]]
            prompts = [p.prompt for p in batch] * 2
            responses = [p.chosen for p in batch] + [p.rejected for p in batch]
            ids, att = encode_pairs(tokenizer, prompts, responses, ended=[True] * len(responses))
            scores = sequence_scores(model, ids, att)  # (2N,), at the EOS
            loss, metrics = bradley_terry_loss(scores[: len(batch)], scores[len(batch) :])
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
    model.eval()
    out = {"reward_model/loss": loss.item(), **{k: v.item() for k, v in metrics.items()}}
    if normalize_on is not None:
        prompts, responses = normalize_on
        with torch.no_grad():
            scores = torch.cat([
                sequence_scores(model, *encode_pairs(tokenizer, prompts[i : i + 64], responses[i : i + 64], ended=[True] * len(responses[i : i + 64])))
                for i in range(0, len(prompts), 64)
            ])
        gain, bias = reference_normalization(scores, normalize)
        model.config.reward_gain, model.config.reward_bias = gain, bias
        out.update({"reward_model/gain": gain, "reward_model/bias": bias})
    with quiet_transformers():
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
    return out
