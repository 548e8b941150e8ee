"""The loss of one micro-batch: a policy loss from the registry, plus the value loss, the
entropy bonus and (with `kl.placement: loss`) the KL to the reference.

Chapter 7 (The PPO trainer end to end) writes the whole objective, to be minimised:

    loss = policy_loss + vf_coef * value_loss - entropy_coef * entropy + kl_coef * KL(pi || pi_ref)

where the last term is present only when the KL penalty sits in the loss (GRPO style) instead of
the per-token reward (chapter 5). The policy loss is looked up by name in a registry, as the
advantage estimators are (`estimators.py`): every policy loss takes the same arguments and
returns `(loss, metrics)`, so a new one (chapter 10) is a function and a decorator, not an edit
of the trainer.
"""

from __future__ import annotations

from typing import Callable

import torch

from .aggregation import aggregate_loss
from .clipping import cispo_policy_loss, clipped_policy_loss, gspo_policy_loss, kl_penalized_policy_loss
from .kl import kl_penalty
from .registry import Registry
from .value import clipped_value_loss

# A policy loss: (logprobs, old_logprobs, advantages, mask, *, settings) -> (loss, metrics);
# all tensors (B, T). Each takes the keyword arguments it needs and ignores the rest (**_):
# clip_eps, clip_eps_high, dual_clip, penalty_beta, loss_agg and norm_length (for
# "seq-mean-token-sum-norm", the generation budget max_new_tokens).
PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
#: The policy losses by name (`loss.policy`), a `Registry`.
POLICY_LOSSES = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register  # make a policy loss available as `loss.policy = name`
get_policy_loss = POLICY_LOSSES.lookup


@register_policy_loss("clip")
def clip_loss(logprobs, old_logprobs, advantages, mask, *, clip_eps, clip_eps_high=None, dual_clip=None, loss_agg="token-mean", norm_length=None, **_):
    """PPO-clip (chapter 6)."""
    return clipped_policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high, dual_clip, loss_agg, norm_length)


@register_policy_loss("ppo_penalty")
def ppo_penalty_loss(logprobs, old_logprobs, advantages, mask, *, penalty_beta, loss_agg="token-mean", norm_length=None, **_):
    """PPO-penalty: the surrogate minus an adaptive KL to the old policy (chapter 6)."""
    return kl_penalized_policy_loss(logprobs, old_logprobs, advantages, mask, penalty_beta, loss_agg, norm_length)


@register_policy_loss("gspo")
def gspo_loss(logprobs, old_logprobs, advantages, mask, *, clip_eps, clip_eps_high=None, loss_agg="token-mean", norm_length=None, **_):
    """GSPO: PPO-clip on each response's geometric-mean ratio (chapter 10)."""
    return gspo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high, loss_agg, norm_length)


@register_policy_loss("cispo")
def cispo_loss(logprobs, old_logprobs, advantages, mask, *, clip_eps, clip_eps_high=None, loss_agg="token-mean", norm_length=None, **_):
    """CISPO: a clipped, stop-gradient importance weight on REINFORCE (chapter 10)."""
    return cispo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high, loss_agg, norm_length)


def ppo_loss(
    policy_loss: PolicyLoss,
    *,
    logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None = None,
    values: torch.Tensor | None,
    batch: dict[str, torch.Tensor],
    vf_coef: float,
    value_clip: float | None,
    entropy_coef: float = 0.0,
    kl_coef: float | None = None,
    kl_estimator: str = "k1",
    loss_agg: str = "token-mean",
    norm_length: float | None = None,
    train_policy: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch, and its metrics (detached 0-dim tensors).

    Args:
        policy_loss: (logprobs, old_logprobs, advantages, mask) -> (loss, metrics), a registered
            policy loss with its settings bound (see `objective.Objective`).
        logprobs: (B, T) log pi_theta of the response tokens, with gradient (None when
            `train_policy` is False: only the value loss is computed).
        entropy: (B, T) the current policy's entropy at each response position, with gradient;
            needed when `entropy_coef` > 0.
        values: (B, T) the current critic's values, with gradient; None without a critic.
        batch: the rollout's rows of this micro-batch, each (B, T): "old_logprobs",
            "ref_logprobs", "advantages", "returns", "mask", and "old_values" with a critic.
        vf_coef, value_clip: the value loss's weight and clip range (None = no clip).
        entropy_coef: the entropy bonus's weight.
        kl_coef: the reference-KL coefficient when the KL sits in the loss (GRPO style); None
            when it sits in the reward (chapter 5) and the loss has no KL term.
        kl_estimator: the per-token KL estimator of that term (k1, k2, k3).
        loss_agg, norm_length: how per-token losses are aggregated (`aggregate_loss`).
        train_policy: False during the critic's warm-up: only the value loss is returned.
    """
    m = batch["mask"]
    loss = torch.zeros((), device=m.device)
    metrics: dict[str, torch.Tensor] = {}
    if train_policy:
        loss, metrics = policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], m)
        metrics["loss/policy"] = loss.detach()
    if values is not None:
        vf_loss, v_metrics = clipped_value_loss(values.float(), batch["old_values"], batch["returns"], m, value_clip, loss_agg, norm_length)
        loss = loss + vf_coef * vf_loss
        metrics.update(v_metrics)
        metrics["loss/value"] = vf_loss.detach()
    if train_policy and entropy_coef > 0:
        if entropy is None:
            raise ValueError("ppo_loss: entropy_coef > 0 needs the policy's `entropy` (B, T)")
        entropy = aggregate_loss(entropy, m, loss_agg, norm_length)
        loss = loss - entropy_coef * entropy
        metrics["loss/entropy"] = entropy.detach()
    if train_policy and kl_coef is not None:
        kl = aggregate_loss(kl_penalty(logprobs, batch["ref_logprobs"], kl_estimator), m, loss_agg, norm_length)
        loss = loss + kl_coef * kl
        metrics["loss/kl"] = kl.detach()
    return loss, metrics
