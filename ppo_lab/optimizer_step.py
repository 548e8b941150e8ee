"""One optimizer step per minibatch: its gradient, the clip, the target-KL stop, the step.

Chapter 7 (The PPO trainer end to end) reads `OptimizerStep.step`; chapter 9 (Scaling up)
explains the micro-batches and processes behind `backward`. The trainer's update shuffles the rollout into minibatches and
hands each one to `step`, which

1. accumulates the minibatch's gradient over micro-batches (`backward`): each process takes its
   share of the rows, in `batch.accumulation_steps` micro-batches, and each micro-batch's loss
   is weighted by its share of the minibatch's normaliser, so the gradient is that of the whole
   minibatch however it is split (aggregation.py); a mean of micro-batch means would weigh the
   tokens of short micro-batches more;
2. clips the gradient norm, of everything at once or of each model alone (`clip_gradients`);
3. drops the gradient without a step when its norm is not finite (a non-finite loss never
   reaches the weights), or when the minibatch's approx KL is past `optim.early_stop_kl`, which ends the
   update (Stable-Baselines3's early stop);
4. otherwise takes the optimizer and scheduler steps.
"""

from __future__ import annotations

import math

import torch

from . import distributed as dist
from .aggregation import micro_batch_weight


class OptimizerStep:
    """The optimizer step of a minibatch, for the prepared `models` (policy, critic or None).

    Args:
        accelerator, optimizer, scheduler: the run's (the optimizer's groups named by `build_optimizer`).
        models: the models whose gradients DDP all-reduces (None entries are skipped).
        minibatch_size, accumulation: responses per minibatch (global), micro-batches per process.
        loss_agg: the loss aggregation (it decides each micro-batch's weight).
        max_grad_norm, clip_scope: the clip (None: no clip) and its scope, "global" or "per-model".
        target_kl: the early-stop threshold on the minibatch's approx KL (None: off).

    The settings are read when the step is built (with the trainer): build a new trainer to
    change them.
    """

    def __init__(self, accelerator, optimizer, scheduler, models, *, minibatch_size: int, accumulation: int, loss_agg: str,
                 max_grad_norm: float | None, clip_scope: str, target_kl: float | None):
        self.accelerator, self.optimizer, self.scheduler, self.models = accelerator, optimizer, scheduler, tuple(models)
        self.minibatch_size, self.accumulation, self.loss_agg = minibatch_size, accumulation, loss_agg
        self.max_grad_norm, self.clip_scope, self.target_kl = max_grad_norm, clip_scope, target_kl

    def counts(self) -> dict[str, float]:
        """The step counters of one update, at 0: steps taken (and fp16 overflows, under fp16)."""
        return {"policy/steps": 0.0, **({"train/overflow_steps": 0.0} if self.accelerator.scaler is not None else {})}

    def step(self, mask: torch.Tensor, minibatch: torch.Tensor, loss_fn, collected: dict, counts: dict, skipped: list) -> bool:
        """One step on the rows `minibatch` of a rollout whose response mask is `mask` (B, T);
        `loss_fn(rows)` gives a micro-batch's (loss, metrics). The step's metrics go to
        `collected`, its count to `counts`, and a step dropped for non-finite gradients to
        `skipped` as (problem, metric, detail). False once past `optim.early_stop_kl`: no further step is
        taken on this batch."""
        step_metrics = self.backward(mask, minibatch, loss_fn)
        # taken after DDP's all-reduce: every process sees the same norm and decides alike
        grad_norms = self.clip_gradients()
        norm = torch.stack(list(grad_norms.values())).norm()  # finite iff every one is
        # Early stop: this minibatch's approx KL, measured before its step, says how far the steps
        # so far moved the policy from the one that sampled the batch. The first minibatch is
        # on-policy (KL 0) when pi_old is the trainer's own fp32 forward, so one step is then always
        # taken (not so when `reproduce` or a sampler that differs makes the rollout off-policy).
        kl = torch.zeros_like(norm)
        if self.target_kl is not None and step_metrics.get("policy/approx_kl"):
            kl = dist.mean_over_processes(self.accelerator, torch.stack([v.float() for v in step_metrics["policy/approx_kl"]]).mean())
        kl_value, norm_value = torch.stack([kl, norm]).tolist()  # the one read-back per minibatch
        if not math.isfinite(norm_value):
            self.drop(step_metrics, norm_value, counts, skipped)
            return True
        if self.target_kl is not None and kl_value > self.target_kl:
            self.drop(step_metrics, norm_value, counts, skipped)
            return False
        for key, values in [*step_metrics.items(), *((k, [v]) for k, v in grad_norms.items())]:
            collected.setdefault(key, []).extend(values)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        counts["policy/steps"] += 1
        return True

    def backward(self, mask: torch.Tensor, minibatch: torch.Tensor, loss_fn) -> dict[str, list[torch.Tensor]]:
        """Accumulate the gradient of the minibatch's loss over this process's micro-batches;
        return each micro-batch's loss metrics."""
        acc, ga = self.accelerator, self.accumulation
        micro = self.minibatch_size // (ga * acc.num_processes)
        mine = minibatch[acc.process_index * ga * micro : (acc.process_index + 1) * ga * micro]  # every process holds the whole rollout
        step_metrics: dict[str, list[torch.Tensor]] = {}
        for j in range(ga):
            rows = mine[j * micro : (j + 1) * micro]
            # this micro-batch's share of the minibatch's normaliser: the same gradient for any split
            weight = micro_batch_weight(mask[rows], mask[minibatch], self.loss_agg, acc.num_processes)
            with dist.no_sync(acc, self.models, last=j == ga - 1):
                loss, metrics = loss_fn(rows)
                acc.backward(loss * weight)
            for key, value in metrics.items():
                step_metrics.setdefault(key, []).append(value)
        return step_metrics

    def drop(self, step_metrics: dict, norm_value: float, counts: dict, skipped: list) -> None:
        """Throw the minibatch's gradient away without a step, and say why when it was not finite."""
        acc = self.accelerator
        # Under fp16 the scaler has already unscaled these gradients and refuses to again until
        # update(), which also lowers the scale.
        if acc.scaler is not None:
            acc.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if math.isfinite(norm_value):
            return  # past optim.early_stop_kl
        bad = [k for k, vs in step_metrics.items() if not all(bool(torch.isfinite(v).all()) for v in vs)]
        if acc.scaler is not None and not bad:
            counts["train/overflow_steps"] += 1  # fp16's scale was too large: how fp16 training starts
        else:
            skipped.append(("non-finite gradients", "policy/grad_norm", f"{norm_value}" + (f"; non-finite: {', '.join(bad)}" if bad else "")))

    def clip_gradients(self) -> dict[str, torch.Tensor]:
        """Clip the gradients to `max_grad_norm`; return their norms before clipping, as metrics:
        "policy/grad_norm" of every trained parameter together (scope "global"), or that of the
        policy's and "critic/grad_norm" of the critic's (or value head's), each clipped alone."""
        acc, limit = self.accelerator, self.max_grad_norm or math.inf
        # build_optimizer names the groups (a checkpoint's optimizer state from before it did not: by order)
        groups = {group.get("name", ("policy", "critic")[i]): group["params"] for i, group in enumerate(self.optimizer.param_groups)}
        device = acc.device
        whole = lambda norm: (norm.full_tensor() if hasattr(norm, "full_tensor") else torch.as_tensor(norm)).detach().float().to(device)  # noqa: E731 (a sharded norm)
        if self.clip_scope == "global" or "critic" not in groups:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            return {"policy/grad_norm": whole(acc.clip_grad_norm_(params, limit))}
        acc.unscale_gradients()  # (fp16: once for the whole optimizer, before either norm)
        return {f"{name}/grad_norm": whole(torch.nn.utils.clip_grad_norm_(groups[name], limit)) for name in ("policy", "critic")}
