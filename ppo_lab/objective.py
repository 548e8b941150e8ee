"""Where the config meets the math: a rollout's advantages, and the loss of a micro-batch.

Chapter 7 (The PPO trainer end to end) reads this module. The math of chapters 2-6 and 10 is
pure functions of tensors and numbers; `PPOConfig` holds which of them a run uses and with what
settings. `Objective` is the one place that reads the one for the other, so that no math function
and no registry entry ever receives a config, and the trainer calls two methods whatever the
recipe:

    advantages(ro, ...)   scores adjusted (chapters 5, 8, 10), KL-shaped per-token rewards
                          (chapter 5), the estimator (chapters 4, 10), whitening (chapter 4):
                          `scores`, `shape`, `estimate`, `normalise`
    loss(...)             the registered policy loss with its settings bound, the value loss, the
                          entropy bonus and the KL in the loss (`losses.ppo_loss`)

The choices that Appendix A reproduces enter through `disagreements.Choices`, whose hooks are
ppo_lab's own choices unless `run.reproduce` names another.
"""

from __future__ import annotations

import functools

import torch

from .batch import Rollout
from .disagreements import Choices
from .estimators import get_advantage_estimator
from .losses import get_policy_loss, ppo_loss
from .masked import masked_whiten
from .shaping import adjust_scores, overlong_penalty, shape_rewards


class Objective:
    """A run's advantages and loss, from its `PPOConfig` and its `Choices`."""

    def __init__(self, config, choices: Choices | None = None):
        self.config = config
        self.choices = choices if choices is not None else Choices()
        # the registered functions, looked up once (Appendix A's choice may replace the estimator per call);
        # every setting is read from `config` at each call, so a changed field takes effect at once
        self.estimator = get_advantage_estimator(config.advantage.estimator)
        self.policy_loss = get_policy_loss(config.loss.policy)

    def advantages(self, ro: Rollout, kl_coef: float, gain: float = 1.0, bias: float = 0.0):
        """(rewards, advantages, returns), each (B, T): the score on the last token minus the KL
        penalty on every token (chapter 5), then the configured estimator (chapters 4, 10), then
        whitening (chapter 4). `kl_coef` is the current KL coefficient, `gain` and `bias` the
        run's fixed score map (`reward.reference_norm`). The rewards are returned for the log."""
        scores = self.scores(ro, gain, bias)  # the reward's scores, adjusted (chapters 5, 8, 10)
        rewards = self.shape(ro, scores, kl_coef)  # score on the last real token, -kl_coef x KL on every token
        advantages, returns = self.estimate(ro, rewards, scores)  # the estimator (GAE by default)
        return rewards, self.normalise(ro, advantages), returns  # mean 0, std 1 over the real tokens

    def scores(self, ro: Rollout, gain: float = 1.0, bias: float = 0.0) -> torch.Tensor:
        """(B,) the scores that are shaped: the reward's, with DAPO's overlong penalty added, then
        the missing-EOS rule, the batch normalisation and the fixed gain and bias (`adjust_scores`)."""
        cfg, raw = self.config, ro.scores
        if cfg.reward.overlong_buffer:  # DAPO's soft overlong punishment, by length alone, added to the reward's score
            raw = raw + overlong_penalty(ro.mask.sum(dim=-1), cfg.sampling.max_new_tokens, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty).to(raw.dtype)
        return adjust_scores(raw, ro.ended, cfg.reward.truncated_penalty, cfg.reward.normalize, truncated_score=cfg.reward.truncated_score, gain=gain, bias=bias)

    def placed(self, scores: torch.Tensor) -> torch.Tensor:
        """(B,) the scores as they sit on the last token: clipped to +-`reward.clip` when it is set."""
        clip = self.config.reward.clip
        return scores.clamp(-clip, clip) if clip is not None else scores

    def shape(self, ro: Rollout, scores: torch.Tensor, kl_coef: float) -> torch.Tensor:
        """(B, T) the per-token rewards (`shape_rewards`); with the KL in the loss, the score alone."""
        cfg = self.config
        shaped = shape_rewards(scores, ro.old_logprobs, ro.ref_logprobs, ro.mask, kl_coef if cfg.kl.placement == "reward" else 0.0, cfg.kl.estimator, cfg.reward.clip)
        return self.choices.place_score(shaped, self.placed(scores), ro.mask)

    def estimate(self, ro: Rollout, rewards: torch.Tensor, scores: torch.Tensor):
        """(advantages, returns), each (B, T), from the configured estimator with `advantage.lam`; the
        critic's targets use `critic.lam` when it is set (VAPO's decoupled lambda). With
        `advantage.whiten_rewards` the estimator sees the rewards scaled to std 1, their mean kept, so the
        sign of the KL penalty survives (OpenAI 2019)."""
        cfg, estimator = self.config, self.choices.estimator(self.estimator)
        if cfg.advantage.whiten_rewards:
            rewards = masked_whiten(rewards, ro.mask, shift_mean=False)
        common = dict(values=ro.values, group_ids=ro.group_ids, scores=self.placed(scores), gamma=cfg.advantage.gamma)
        advantages, returns = estimator(rewards, ro.mask, lam=cfg.advantage.lam, **common)
        if cfg.critic.lam is not None and cfg.critic.lam != cfg.advantage.lam:
            _, returns = estimator(rewards, ro.mask, lam=cfg.critic.lam, **common)
        return advantages, returns

    def normalise(self, ro: Rollout, advantages: torch.Tensor) -> torch.Tensor:
        """(B, T) the advantages whitened over the real tokens (`advantage.whiten`). With DAPO's
        `advantage.drop_truncated` a response that ran out of tokens gets advantage 0 and does not shape
        the whitening."""
        cfg = self.config
        counted = ro.mask
        if cfg.advantage.drop_truncated and bool(ro.ended.any()):
            counted = ro.mask * ro.ended.to(ro.mask.dtype)[:, None]
        if cfg.advantage.whiten:
            advantages = self.choices.whiten(advantages, counted)
        if cfg.advantage.drop_truncated:
            advantages = advantages * ro.ended.to(advantages.dtype)[:, None]
        return advantages

    def loss(self, *, logprobs, entropy, values, batch, kl_coef: float, penalty_beta: float, train_policy: bool = True):
        """The loss of one micro-batch and its metrics (`losses.ppo_loss`, with this run's
        settings); `kl_coef` and `penalty_beta` are the controllers' current values."""
        cfg = self.config
        # seq-mean-token-sum-norm divides by the generation budget, not by a batch's padded width
        # (which is its longest response: sampling stops when every response has)
        norm_length = float(cfg.sampling.max_new_tokens)
        policy_loss = functools.partial(
            self.policy_loss, clip_eps=cfg.loss.clip_eps, clip_eps_high=cfg.loss.clip_eps_high, dual_clip=cfg.loss.dual_clip,
            penalty_beta=penalty_beta, loss_agg=cfg.loss.aggregation, norm_length=norm_length,
        )
        return ppo_loss(
            policy_loss, logprobs=logprobs, entropy=entropy, values=values, batch=batch, vf_coef=cfg.critic.loss_coef, value_clip=cfg.critic.clip,
            entropy_coef=cfg.loss.entropy_coef, kl_coef=kl_coef if cfg.kl.placement == "loss" else None, kl_estimator=cfg.kl.estimator,
            loss_agg=cfg.loss.aggregation, norm_length=norm_length, train_policy=train_policy,
        )
