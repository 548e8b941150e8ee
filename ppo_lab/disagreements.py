"""Where the big implementations disagree: the other choices, reproduced.

Appendix A (Where the big implementations disagree) runs each decision of the book's decisions table
both ways. `ppo_lab` makes one choice in each; this module holds the table as data (`DECISIONS`,
kept equal to the book's by a test) and the other choices as pure functions. `Choices` is what
the trainer sees: one hook per decision, which it calls on every run, and which applies the
other choice only when `run.reproduce` names it (off by default, used by Appendix A to run
each decision both ways, never by a recipe):

    score-past-last           the score one position past the last real token (TRL, DeepSpeed-Chat)
    gae-over-padding          the GAE recursion over every position, padding included (TRL, AlpacaFarm)
    whiten-with-padding       advantages whitened with padded positions counted (AlpacaFarm)
    temperature-1-in-scoring  sampling at the temperature, every log-prob forward at 1 (the bug
                              the temperature row guards against)
    dropout-on                dropout left at p = 0.1 in the trained models (GPT-2's default)

The k3 forms and the source of the rollout's log-probs need no switch: `k3_exp_minus_one` and
`k3_clamped` are the anchors' formulas, and `sampler.old_logprobs_from` already chooses the source.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._checks import check_float, check_mask, check_range, check_same_shape, check_tensor
from .masked import masked_whiten
from .shaping import last_real_index

OTHER_CHOICES = ("score-past-last", "gae-over-padding", "whiten-with-padding", "temperature-1-in-scoring", "dropout-on")
DROPOUT_ON_P = 0.1  # GPT-2's (and the tiny model's) configured resid/embd/attn dropout


@dataclass(frozen=True)
class Decision:
    """One row of the book's table "Decisions where the big implementations disagree"."""

    question: str  # the table's first column, verbatim
    ours: str  # what ppo_lab does, in a few words
    other: str  # how to reproduce the other choice: a `reproduce` name, a field or a function


DECISIONS = (
    Decision("where the sequence score goes", "the last real token", "run.reproduce: score-past-last"),
    Decision("padding in the GAE recursion", "skipped", "run.reproduce: gae-over-padding"),
    Decision("advantage whitening", "over the mask", "run.reproduce: whiten-with-padding"),
    Decision("temperature", "the same tau everywhere", "run.reproduce: temperature-1-in-scoring"),
    Decision("the k3 KL estimator", "expm1(log r) - log r", "k3_exp_minus_one, k3_clamped"),
    Decision("where the rollout's log-probs come from", "the sampling logits in fp32", "sampler.old_logprobs_from: forward"),
    Decision("dropout during PPO", "off", "run.reproduce: dropout-on"),
)


def parse_reproduce(value: str | None) -> tuple[str, ...]:
    """The names in a comma-separated `reproduce` value, each checked against `OTHER_CHOICES`."""
    names = tuple(n.strip() for n in (value or "").split(",") if n.strip())
    for name in names:
        if name not in OTHER_CHOICES:
            raise ValueError(f"run.reproduce names {name!r}, which is not one of: {', '.join(OTHER_CHOICES)}")
    return names


def score_past_last(rewards: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Move each response's score from its last real token one position on, as TRL does.

    Args:
        rewards: (B, T) shaped rewards with the score on the last real token (`shape_rewards`).
        scores: (B,) the scores that were added there (after any clipping).
        mask: (B, T) 1 on real response tokens.

    Returns:
        (B, T) the same rewards with each score at index last + 1: a padded position, whose
        reward `compute_gae` never reads (the score is lost), and which a recursion over padding
        (`gae_over_padding`) carries back to the last real token through one value. A response
        that fills all T positions keeps its score on the last one (TRL's `actual_end` falls back
        the same way).
    """
    check_same_shape(rewards=rewards, mask=mask)
    check_tensor("scores", scores, ndim=1)
    last = last_real_index(mask)
    target = (last + 1).clamp(max=rewards.shape[1] - 1)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    moved = rewards.clone()
    moved[rows, last] -= scores.to(rewards.dtype)
    moved[rows, target] += scores.to(rewards.dtype)
    return moved


def gae_over_padding(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with the recursion run over every position, padding included (TRL, AlpacaFarm).

    Args and shapes as `ppo_lab.gae.compute_gae`; `mask` is only checked, never used: rewards
    and values at padded positions enter the TD errors, and the value after position T - 1 is 0.

    Returns:
        advantages, returns: (B, T), at every position (the losses read the real ones only).
        At the last real token the TD error is r + gamma * V(first padded position) - V, and the
        advantages of the padded positions flow back into it: whatever the critic outputs on
        padding, a position it is never trained on, leaks into the real advantages.
    """
    check_same_shape(rewards=rewards, values=values, mask=mask)
    check_tensor("rewards", rewards, ndim=2)
    check_float(rewards=rewards, values=values)
    check_mask(mask, rewards, "rewards")
    gamma = check_range("gamma", gamma, 0.0, 1.0)
    lam = check_range("lam", lam, 0.0, 1.0)
    v = values.to(rewards.dtype)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_adv = rewards[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
        next_value = v[:, t]
        advantages[:, t] = next_adv
    return advantages, advantages + v


def whiten_with_padding(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(B, T) advantages whitened over every position, padding counted, as AlpacaFarm's
    `torch_ops.whiten` does: (x - mean) / (std + eps) with the plain mean and the population
    standard deviation of the whole tensor.

    The padded positions (0 after `compute_gae`) pull the mean towards 0 and change the spread,
    so over the real tokens the result has neither mean 0 nor std 1, and how far it is from them
    depends on how much padding the batch holds. `mask` is only checked.
    """
    check_same_shape(advantages=advantages, mask=mask)
    check_float(advantages=advantages)
    x = advantages.double()
    return ((x - x.mean()) / (x.std(unbiased=False) + eps)).to(advantages.dtype)


def k3_exp_minus_one(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 as TRL writes it: (exp(log r) - 1) - log r, log r = ref_logprobs - logprobs. (B, T).

    Mathematically `kl_penalty(..., "k3")`; in floating point, exp(x) - 1 loses the digits of a
    small x (below about 1e-4 in float32 the result is rounding noise and can be negative).
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_ratio = ref_logprobs - logprobs
    return (torch.exp(log_ratio) - 1) - log_ratio


def k3_clamped(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, log_ratio_limit: float = 20.0, kl_limit: float = 10.0) -> torch.Tensor:
    """k3 as verl's `kl_penalty` computes it ("low_var_kl"): log r clamped to +-20, the result to +-10. (B, T).

    With log r = ref_logprobs - logprobs, k3 grows like exp(log r) for a token the policy finds
    far less likely than the reference does (and only linearly on the other side); the clamps
    bound that side and its gradient, so beyond them the estimate is no longer k3.
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_ratio = (ref_logprobs - logprobs).clamp(-log_ratio_limit, log_ratio_limit)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-kl_limit, kl_limit)


def dropout_on(model: nn.Module, p: float = DROPOUT_ON_P) -> nn.Module:
    """Set every dropout module of `model` to probability `p` (undoing `models.disable_dropout`).

    The trainer samples and scores in eval mode and updates in train mode, so with dropout on
    the first update step's log-probs are those of a randomly thinned network: the ratio is not
    1 on-policy, and the clip fraction counts noise.
    """
    p = check_range("p", p, 0.0, 1.0, high_open=True)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p
    return model


class Choices:
    """The trainer's hook at each decision that a switch reproduces: ppo_lab's own choice, or the
    other implementations' for the names in `names` (see `parse_reproduce`). The trainer calls
    every hook on every run and tests no names; with no names each hook is ppo_lab's choice."""

    def __init__(self, names: tuple[str, ...] = ()):
        self.names = parse_reproduce(",".join(names))

    @classmethod
    def parse(cls, value: str | None) -> Choices:
        """The choices of a `run.reproduce` value (comma-separated names, or None)."""
        return cls(parse_reproduce(value))

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def prepare(self, models) -> None:
        """dropout-on: dropout at `DROPOUT_ON_P` in every trained model (ppo_lab keeps it off)."""
        if "dropout-on" in self:
            for model in models:
                dropout_on(model)

    def score_temperature(self, temperature: float) -> float:
        """The temperature of every log-prob forward: the sampling one (temperature-1-in-scoring: 1)."""
        return 1.0 if "temperature-1-in-scoring" in self else temperature

    def place_score(self, rewards: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) the shaped rewards, with the score on the last real token (score-past-last:
        one position on); `scores` (B,) are those `shape_rewards` placed."""
        return score_past_last(rewards, scores, mask) if "score-past-last" in self else rewards

    def estimator(self, estimator):
        """The advantage estimator (gae-over-padding: GAE's recursion over every position)."""
        if "gae-over-padding" not in self:
            return estimator
        return lambda rewards, mask, values, gamma, lam, **_: gae_over_padding(rewards, values, mask, gamma, lam)

    def whiten(self, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) advantages whitened over the real tokens (whiten-with-padding: over every position)."""
        return whiten_with_padding(advantages, mask) if "whiten-with-padding" in self else masked_whiten(advantages, mask)


@torch.no_grad()
def first_step_metrics(trainer) -> dict[str, float]:
    """What the first optimizer step of an update of `trainer` (a `PPOTrainer`) would see, without
    taking it: a rollout of the first `batch.minibatch` training prompts, then the loss metrics of
    that minibatch under the current weights in train mode. On-policy (dropout off, one
    temperature in sampling and scoring) every ratio is 1, so policy/ratio_min = ratio_max = 1
    and policy/clipfrac = 0, up to float round-off; the dropout-on and temperature-1-in-scoring
    choices break that (appendices A and C). The weights, the prompt stream and the iteration
    count are left as they were."""
    k = trainer.config.sampling.responses_per_prompt
    ro = trainer.rollout(trainer.train_prompts[: max(trainer.config.batch.minibatch // k, 1)])
    _, advantages, returns = trainer.advantages(ro)
    trainer.set_training(True)
    _, metrics = trainer.minibatch_loss(ro, torch.arange(len(ro), device=ro.mask.device), advantages, returns)
    trainer.set_training(False)
    return {key: value.item() for key, value in metrics.items()}
