"""One PPO update of a scored batch, composed from the pieces of chapters 1-6.

Chapter 7 (The PPO trainer) walks through `PPOTrainer`, which does this with every switch of
`PPOConfig` (other estimators and losses, micro-batches, several processes, gradient clipping,
early stopping on a target KL, a learning-rate schedule). This function is the update that the
trainer's default switches give, without gradient clipping and the target-KL early stop, short
enough to read in one screen and to write as an exercise (the course's `ppo_update` assignment):

    rewards    = shape_rewards(scores, old_logprobs, ref_logprobs, mask, kl_coef)   chapter 5
    A, R       = compute_gae(rewards, old_values, mask, gamma, lam)                 chapter 4
    A          = masked_whiten(A, mask)                                             chapter 4
    for each epoch, for each shuffled minibatch:
        loss   = clipped_policy_loss(...) + vf_coef * clipped_value_loss(...)       chapter 6
        one optimizer step on it

`tests/test_update.py` checks that it moves a model's weights exactly as `PPOTrainer.update`
does under the same settings (`optim.max_grad_norm` and `optim.early_stop_kl` None, the constant learning
rate), to float round-off.
"""

from __future__ import annotations

from typing import Callable

import torch

from ._checks import check_float, check_mask, check_range, check_same_shape, check_tensor
from .clipping import clipped_policy_loss
from .gae import compute_gae
from .masked import masked_whiten
from .shaping import shape_rewards
from .value import clipped_value_loss

Forward = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


def ppo_update(
    forward: Forward,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    *,
    kl_coef: float,
    gamma: float = 1.0,
    lam: float = 0.95,
    clip_eps: float = 0.2,
    value_clip: float | None = 0.2,
    vf_coef: float = 0.5,
    epochs: int = 4,
    minibatch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Shape the rewards, estimate whitened GAE advantages, then take PPO-clip steps on them.

    Args:
        forward: `forward(rows)` with rows a (b,) long tensor of batch rows returns the current
            model's `(logprobs, values)`, each (b, T) with gradient: log pi_theta of the rows'
            response tokens (at the sampling temperature) and the critic's V(s_t).
        optimizer: steps the parameters that `forward` uses.
        batch: the scored rollout, B responses padded to T tokens: "scores" (B,) one score per
            response; "old_logprobs", "ref_logprobs", "old_values" and "mask" (B, T), the policy's
            and the reference's log-probs and the critic's values at sampling time, and 1 on real
            tokens (the EOS included).
        kl_coef: beta of the KL penalty in the reward (k1 estimator).
        gamma, lam: GAE's discount and lambda.
        clip_eps: PPO's clip range for the ratio; value_clip: the critic's (None: no clipping).
        vf_coef: weight of the value loss in the one loss both models step on.
        epochs: passes over the batch; minibatch_size: rows per optimizer step (None: B).
        generator: the CPU random generator of the shuffles (None: torch's global one).

    Returns:
        advantages: (B, T) whitened over the real tokens, 0 on padding.
        returns: (B, T) the critic's targets (lambda-returns before whitening), 0 on padding.
        metrics: floats averaged over the steps: "policy/clipfrac", "policy/approx_kl",
            "value/clipfrac", "loss/policy", "loss/value", and "policy/steps" (their count).
    """
    keys = ("old_logprobs", "ref_logprobs", "old_values", "mask")
    missing = [k for k in ("scores", *keys) if k not in batch]
    if missing:
        raise ValueError(f"`batch` lacks {missing}; it needs 'scores' (B,) and {list(keys)} (B, T)")
    check_same_shape(**{k: batch[k] for k in keys})
    check_tensor("old_logprobs", batch["old_logprobs"], ndim=2)
    check_float(**{k: batch[k] for k in keys[:3]})
    mask = check_mask(batch["mask"], batch["old_logprobs"], "old_logprobs")
    n = mask.shape[0]
    epochs = int(check_range("epochs", epochs, low=1))
    minibatch_size = n if minibatch_size is None else int(check_range("minibatch_size", minibatch_size, low=1))
    ### BEGIN SOLUTION ppo_update
    old_logprobs, old_values = batch["old_logprobs"], batch["old_values"]
    rewards = shape_rewards(batch["scores"], old_logprobs, batch["ref_logprobs"], mask, kl_coef)
    advantages, returns = compute_gae(rewards, old_values, mask, gamma, lam)
    advantages = masked_whiten(advantages, mask)
    collected: dict[str, list[float]] = {}
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator).to(mask.device)
        for start in range(0, n, minibatch_size):
            rows = order[start : start + minibatch_size]
            logprobs, values = forward(rows)
            policy_loss, metrics = clipped_policy_loss(logprobs, old_logprobs[rows], advantages[rows], mask[rows], clip_eps)
            value_loss, v_metrics = clipped_value_loss(values, old_values[rows], returns[rows], mask[rows], value_clip)
            optimizer.zero_grad(set_to_none=True)
            (policy_loss + vf_coef * value_loss).backward()
            optimizer.step()
            step = {**metrics, **v_metrics, "loss/policy": policy_loss.detach(), "loss/value": value_loss.detach()}
            for key in ("policy/clipfrac", "policy/approx_kl", "value/clipfrac", "loss/policy", "loss/value"):
                collected.setdefault(key, []).append(float(step[key]))
    metrics = {key: sum(v) / len(v) for key, v in collected.items()}
    metrics["policy/steps"] = float(len(collected["loss/policy"]))
    return advantages, returns, metrics
    ### END SOLUTION
