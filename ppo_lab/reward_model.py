"""Reward models from preference pairs: the Bradley-Terry loss and a small trainer.

Chapter 8 (Reward models) derives and uses it. Given a prompt x and two responses, a labeller
prefers y_w over y_l. The Bradley-Terry model says P(y_w > y_l) = sigmoid(r(x, y_w) - r(x, y_l)),
so a reward model r is fitted by minimising

    L = -E[ log sigmoid(r(x, y_w) - r(x, y_l)) ]

(Ouyang et al. 2022, eq. 1). Only differences of rewards are identified: adding a constant to r
changes nothing, which is why RLHF pipelines often normalise the score afterwards.

`train_reward_model` fits a 1-label sequence classifier (by default initialised from the tiny
offline model) and saves it with `save_pretrained`, so it plugs into the trainer as
`PPOConfig(reward="<folder>")` like any reward model from the hub.
"""

from __future__ import annotations

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


@dataclass
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


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
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
) -> dict:
    """Fit a 1-label sequence classifier to `pairs` with the Bradley-Terry loss and save it.

    Returns the metrics of the last step. The folder holds the model and its tokenizer.
    """
    from transformers import AutoModelForSequenceClassification

    from .hf import quiet_transformers
    from .models import disable_dropout, load_pretrained, load_tokenizer

    if not pairs:
        raise ValueError("no preference pairs to train on")
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(base)
    tokenizer.padding_side = "right"
    model = load_pretrained(AutoModelForSequenceClassification, base, "reward model base", new_weights=True, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    disable_dropout(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    metrics = {}
    for _ in range(steps):
        batch = rng.sample(pairs, min(batch_size, len(pairs)))
        texts = [f"{p.prompt} {p.chosen}" for p in batch] + [f"{p.prompt} {p.rejected}" for p in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        scores = model(**enc).logits.squeeze(-1)  # (2N,)
        loss, metrics = bradley_terry_loss(scores[: len(batch)], scores[len(batch) :])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    with quiet_transformers():
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
    return {"reward_model/loss": loss.item(), **{k: v.item() for k, v in metrics.items()}}
