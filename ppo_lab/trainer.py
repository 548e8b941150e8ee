"""The PPO trainer: rollout, reward shaping, advantages, clipped updates, repeat.

Chapter 7 (The PPO trainer end to end) reads this file from top to bottom. The loop composes
the pure functions of the earlier chapters and contains no math of its own:

    for each iteration:
        rollout     = sample responses, score tokens with policy / reference / critic  (rollout.py)
        scores      = reward(prompts, responses), adjusted                              (rewards.py, shaping.py)
        rewards     = shape_rewards(scores, logprobs, ref_logprobs, mask, beta)         (chapter 5)
        advantages  = estimator(rewards, mask, values, ...)                             (chapters 4, 10)
        for epoch in ppo_epochs, for minibatch in shuffled minibatches:
            loss = clipped_policy_loss + vf_coef * clipped_value_loss - entropy bonus  (chapters 6, 4)
            backward, clip gradients, optimizer and scheduler step
        KL controller update                                                            (chapter 5)

How it departs from the textbook algorithm, on purpose:
1. The score sits on the last real token; padding never enters GAE (see shaping.py, gae.py).
2. Log-probs are always taken at the sampling temperature, for the policy and the reference.
3. Dropout is off in every model, so the first update step is exactly on-policy (ratio = 1).
4. The KL penalty uses the rollout log-probs (fixed during the update) when it is in the
   reward; with `kl_in="loss"` it is recomputed with gradients at every step (GRPO style).
5. With gradient accumulation, each micro-batch's aggregated loss is divided by the number of
   micro-batches (as TRL and verl do), so "token-mean" is a mean of micro-batch means.
6. Every random draw of an iteration (the sampled tokens, the minibatch order) comes from a
   generator seeded by (seed, iteration), and each response's tokens depend only on its own
   draws. So a run split over N processes samples the same responses as one process, and a
   run resumed from a checkpoint continues exactly as the unbroken run would have.
7. Non-finite rewards, losses or gradients never reach the weights: the optimizer step is
   skipped with a warning that names the phase and the metric, and after `max_bad_updates`
   skipped updates the run stops, its last checkpoint untouched.

Several processes (`accelerate launch`): each samples and scores its share of the rollout, the
rollout is gathered so every process holds the whole batch (whitening, KL control and metrics
are global), and each process trains on its micro-batches of every minibatch; DDP averages
the gradients. See `PPOConfig`'s module docstring for the batch arithmetic.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import resource
import shutil
import time
import uuid
import warnings
from pathlib import Path

import torch

from . import checkpoint as ckpt
from .aggregation import aggregate_loss
from .clipping import clipped_policy_loss, kl_penalized_policy_loss
from .config import PPOConfig
from .estimators import get_advantage_estimator
from .kl import kl_penalty
from .kl_control import AdaptiveKLController, FixedKLController, PPOPenaltyKLController
from .logprobs import entropy_from_logits, logprobs_from_logits
from ._checks import NonFiniteError, skip_value_checks
from .masked import masked_mean, masked_whiten
from .models import (
    PolicyWithValueHead,
    disable_dropout,
    _quiet_transformers,
    context_length,
    load_critic,
    load_tokenizer,
    make_reference,
    to_float32,
)
from .rewards import check_scores, load_reward
from .rollout import Rollout, critic_values, generate, response_logits, sample, score_tokens
from .shaping import adjust_scores, shape_rewards
from .value import clipped_value_loss


# torch.compile's backend for `PPOConfig.torch_compile` (the tests switch to "eager", which traces
# the same graphs in seconds instead of minutes on a CPU).
COMPILE_BACKEND = "inductor"

# What a run writes in output_dir; overwrite_output_dir removes all of it.
# A folder "holds a run" when it has the first four (results); the rest is removed with them.
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "checkpoints", "policy", "config.yaml", "run.json", "ppo_lab")  # ppo_lab/: accelerate's tracker logs

# Fixed stream numbers (not hash(), which changes between processes) for `_generator`.
_STREAMS = {"sample": 1, "shuffle": 2, "eval": 3}


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class PPOTrainer:
    """PPO for a causal LM. Everything not passed in is built from `config`.

    Args:
        config: the `PPOConfig`.
        policy, tokenizer: an already loaded `AutoModelForCausalLM` and its tokenizer (optional).
        reward_fn: a callable (prompts, responses) -> scores (optional; default from config).
        train_prompts, eval_prompts: lists of prompt strings (optional; default: the task's).
    """

    def __init__(self, config: PPOConfig, *, policy=None, tokenizer=None, reward_fn=None, train_prompts=None, eval_prompts=None):
        from accelerate import Accelerator

        self.config = cfg = config
        seed_everything(cfg.seed)
        if cfg.precision == "fp16" and not torch.cuda.is_available():
            raise ValueError("PPOConfig.precision = 'fp16' needs a CUDA GPU; use 'fp32' or 'bf16' on the CPU")
        log_with = [t.strip() for t in cfg.report_to.split(",")] if cfg.report_to else None
        from accelerate.state import AcceleratorState

        # accelerate keeps one global state per process; a second trainer in the same notebook
        # with another precision would be refused. The process group (PartialState) is kept.
        AcceleratorState._reset_state(reset_partial_state=False)
        self.accelerator = Accelerator(
            cpu=not torch.cuda.is_available(),
            mixed_precision="no" if cfg.precision == "fp32" else cfg.precision,
            log_with=log_with,
            project_dir=cfg.output_dir,
            dynamo_backend=COMPILE_BACKEND if cfg.torch_compile else "no",
        )
        check_distributed_backend(self.accelerator.distributed_type)
        cfg.check_divisibility(self.accelerator.num_processes)
        self.device = self.accelerator.device
        self.output_dir = Path(cfg.output_dir)
        if not cfg.resume_from:
            self._check_output_dir()  # before minutes of loading, not after

        # --- the task, its prompts and the reward ---------------------------------------
        self.task = None
        if train_prompts is None or (reward_fn is None and cfg.reward is None):
            from .tasks import get_task

            self.task = get_task(cfg.task)
        self.train_prompts = list(train_prompts if train_prompts is not None else self.task.train_prompts)
        self.eval_prompts = list(eval_prompts if eval_prompts is not None else (self.task.eval_prompts if self.task else self.train_prompts))
        if not self.train_prompts:
            raise ValueError("the prompt set is empty: give at least one training prompt")
        if not all(isinstance(p, str) and p for p in self.train_prompts):
            raise ValueError("every prompt must be a non-empty string")
        self.reward_fn = reward_fn or load_reward(cfg.reward, self.task, cfg.reward_label_index, self.device, cfg.trust_remote_code)
        name = getattr(self.reward_fn, "__qualname__", type(self.reward_fn).__name__)
        module = getattr(self.reward_fn, "__module__", None)
        self.reward_name = f"{module}.{name}" if module and module not in ("__main__", "builtins") and not module.startswith("ppo_lab") else name

        # --- the four roles -------------------------------------------------------------
        self.tokenizer = tokenizer or load_tokenizer(cfg.tokenizer or cfg.policy_model, cfg.trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"
        if policy is None:
            from .lora import load_maybe_adapter

            # an SFT model saved as a LoRA adapter is merged into its base first, so that the
            # reference (and a PPO adapter switched off) is the SFT policy, not the base model
            policy = load_maybe_adapter(cfg.policy_model, cfg.trust_remote_code)
        else:
            policy = to_float32(policy, "policy")
        # A model passed in keeps the dropout it was built with; off, as for a loaded one, or the
        # first update step would not be on-policy.
        lm = disable_dropout(policy)
        self.stop_ids = [self.tokenizer.eos_token_id]
        if cfg.stop_token is not None:
            stop = self.tokenizer.convert_tokens_to_ids(cfg.stop_token)
            if stop is None or stop == self.tokenizer.unk_token_id:
                raise ValueError(f"PPOConfig.stop_token = {cfg.stop_token!r} is not a token of the tokenizer")
            self.stop_ids.append(stop)
        self._check_prompt_lengths(lm)
        if cfg.lora_r > 0:
            from .lora import LoRAReference, apply_lora

            # LoRA's dropout modules are new: switched off like every other dropout
            lm = disable_dropout(apply_lora(lm, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules))
            # The reference is the same weights with the adapter switched off: no second copy.
            self.reference = LoRAReference(lm)
        else:
            self.reference = make_reference(lm).to(self.device)
        if cfg.critic == "shared":
            self.policy = PolicyWithValueHead(lm)
            self.critic = None
        elif cfg.critic == "none":
            self.policy, self.critic = lm, None
        else:
            self.policy = lm
            self.critic = load_critic(cfg.critic_model or cfg.policy_model, cfg.trust_remote_code)
        if cfg.gradient_checkpointing:
            for model in (lm, self.critic.backbone if self.critic is not None else None):
                if model is not None:
                    enable_checkpointing(model)

        # --- optimisation ---------------------------------------------------------------
        params = [p for p in self.policy.parameters() if p.requires_grad]
        params += [p for p in self.critic.parameters() if p.requires_grad] if self.critic is not None else []
        # The fused kernel updates all tensors in one pass: on a CPU a third of the time of the
        # default one-tensor-at-a-time loop (benchmarks/results/hotspots-*.json).
        fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64) for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, **({"fused": True} if fused else {}))
        steps_per_iteration = cfg.ppo_epochs * (cfg.rollout_batch_size // cfg.minibatch_size)
        from transformers import get_scheduler

        # Not passed to accelerator.prepare: its scheduler wrapper steps once per process.
        self.scheduler = get_scheduler(
            {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.lr_schedule],
            self.optimizer,
            num_warmup_steps=cfg.warmup_steps,
            num_training_steps=cfg.total_iterations * steps_per_iteration,
        )
        if self.critic is not None:
            self.policy, self.critic, self.optimizer = self.accelerator.prepare(self.policy, self.critic, self.optimizer)
        else:
            self.policy, self.optimizer = self.accelerator.prepare(self.policy, self.optimizer)
        if cfg.kl_control == "adaptive":
            self.kl_ctl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
        else:
            self.kl_ctl = FixedKLController(cfg.kl_coef)
        self.estimator = get_advantage_estimator(cfg.advantage_estimator)
        # Old log-probs from the sampling logits save a forward; in half precision the cached
        # and the full forward disagree by ~1e-2 nats, so they are recomputed there.
        self.old_logprobs_from = cfg.old_logprobs if cfg.old_logprobs != "auto" else ("sampling" if cfg.precision == "fp32" else "forward")
        # PPO-penalty's beta (KL to the *old* policy) is separate from the reference-KL coefficient.
        self.penalty_ctl = PPOPenaltyKLController(cfg.penalty_beta, cfg.penalty_kl_target) if cfg.policy_loss == "kl_penalty" else None

        # --- bookkeeping ----------------------------------------------------------------
        self.iteration = 0
        self.bad_updates = 0
        self._skipped: list[tuple[str, str, str]] = []  # (phase, metric, detail) of this iteration
        self.history: list[dict] = []
        self._prompt_order: list[int] = []
        self._prompt_rng = random.Random(cfg.seed)
        self.run_id = uuid.uuid4().hex  # a resumed run takes its checkpoint's
        self.resumed_from: Path | None = None
        if cfg.resume_from:
            self.resume(cfg.resume_from)

    # ------------------------------------------------------------------------------------
    def _check_prompt_lengths(self, lm) -> None:
        limit = context_length(lm)
        if limit is None:
            return
        for prompts in (self.train_prompts, self.eval_prompts):
            lengths = [len(ids) for ids in self.tokenizer(prompts, add_special_tokens=False)["input_ids"]]
            for i, n in enumerate(lengths):
                if n + self.config.max_new_tokens > limit:
                    raise ValueError(
                        f"prompt {i} has {n} tokens; with max_new_tokens = {self.config.max_new_tokens} that is "
                        f"{n + self.config.max_new_tokens} positions, more than the model's context of {limit}"
                    )
                if n == 0:
                    raise ValueError(f"prompt {i} is empty after tokenization")

    def _bare(self, model):
        """`model` without accelerate's wrappers (DDP, torch.compile; the mixed-precision
        forward is kept): what its own attributes, state dict and value head belong to."""
        return self.accelerator.unwrap_model(model, keep_torch_compile=False)

    @property
    def lm(self):
        """The bare causal LM inside the (possibly wrapped) policy, for generation and saving."""
        policy = self._bare(self.policy)
        return policy.lm if isinstance(policy, PolicyWithValueHead) else policy

    def _modes(self, training: bool) -> None:
        """Train mode for the update, eval mode for sampling and scoring, for every model that trains.

        Dropout is off either way; the mode matters for gradient checkpointing, which is active
        in train mode only and, in a decoding step, would drop the KV cache.
        """
        for model in (self.policy, self.critic):
            if model is not None:
                model.train(training)

    def next_prompts(self) -> list[str]:
        """The next `rollout_batch_size / responses_per_prompt` prompts, reshuffled every epoch."""
        n = self.config.rollout_batch_size // self.config.responses_per_prompt
        out = []
        while len(out) < n:
            if not self._prompt_order:
                self._prompt_order = list(range(len(self.train_prompts)))
                self._prompt_rng.shuffle(self._prompt_order)
            out.append(self.train_prompts[self._prompt_order.pop()])
        return out

    def _generator(self, stream: str, iteration: int | None = None) -> torch.Generator:
        """A CPU generator for one purpose of one iteration, the same on every process."""
        it = self.iteration if iteration is None else iteration
        return torch.Generator().manual_seed((self.config.seed * 1_000_003 + it) * 8 + _STREAMS[stream])

    def _shard(self, n: int) -> tuple[int, int]:
        """The rows [lo, hi) of a global batch of n that this process handles."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        return rank * n // world, (rank + 1) * n // world

    def _gather(self, tensor: torch.Tensor, pad_value=0, pad_first: bool = False) -> torch.Tensor:
        """Concatenate every process's rows (after padding dim 1 to the longest)."""
        if self.accelerator.num_processes == 1:
            return tensor
        if tensor.dim() > 1:
            tensor = self.accelerator.pad_across_processes(tensor, dim=1, pad_index=pad_value, pad_first=pad_first)
        return self.accelerator.gather(tensor)

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, prompts: list[str]) -> Rollout:
        """Sample `responses_per_prompt` responses per prompt and score them.

        Each process samples and scores its share; the returned rollout is the whole batch.
        The reward is checked for shape here; non-finite scores are left for `step` to handle.
        """
        cfg, k = self.config, self.config.responses_per_prompt
        repeated = [p for p in prompts for _ in range(k)]
        group_ids = torch.arange(len(prompts)).repeat_interleave(k)
        lo, hi = self._shard(len(repeated))
        mine = repeated[lo:hi]
        uniforms = torch.rand(len(repeated), cfg.max_new_tokens, generator=self._generator("sample"))[lo:hi]
        stop_ids = [] if cfg.ignore_eos else self.stop_ids
        self._modes(training=False)
        from_sampling = self.old_logprobs_from == "sampling"
        policy = self._bare(self.policy)
        value_head = policy.v_head if from_sampling and isinstance(policy, PolicyWithValueHead) else None
        # One autocast region for every forward of the rollout: the sampling loop (which calls
        # the bare LM, outside the autocast wrapper accelerate puts on the prepared model's
        # forward when that model is a `PolicyWithValueHead`), the reference (never prepared)
        # and the critic all run in the same precision, so the KL to the reference is
        # exactly 0 before the first update in bf16 too; and the bf16 copies of the fp32
        # weights are made once per rollout, not once per generated token.
        with self.accelerator.autocast():
            drawn = sample(
                self.lm, self.tokenizer, mine, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, stop_ids, self.device,
                uniforms=uniforms, with_logprobs=from_sampling, value_head=value_head,
            )
            query_ids, query_mask, response_ids, mask = drawn.query_ids, drawn.query_mask, drawn.response_ids, drawn.mask
            logprobs, ref_logprobs, values, entropy = score_tokens(
                self.policy, self.reference, self.critic, query_ids, query_mask, response_ids, mask, cfg.temperature,
                logprobs=drawn.logprobs, entropy=drawn.entropy, values=drawn.values, batch_size=cfg.forward_batch_size,
            )
        responses = self.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        scores = check_scores(self.reward_fn(mine, responses), len(mine), f"reward {self.reward_name}", finite=False).to(self.device)
        has_eos = torch.isin(response_ids, torch.tensor(stop_ids, dtype=torch.long, device=self.device)).any(dim=1)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            pad = self.tokenizer.pad_token_id
            responses = gather_object(responses)
            query_ids = self._gather(query_ids, pad, pad_first=True)
            query_mask = self._gather(query_mask, 0, pad_first=True)
            response_ids = self._gather(response_ids, pad)
            mask, logprobs, ref_logprobs, entropy = (self._gather(t) for t in (mask, logprobs, ref_logprobs, entropy))
            values = self._gather(values) if values is not None else None
            scores = self._gather(scores)
            has_eos = self._gather(has_eos.long()).bool()
        return Rollout(repeated, responses, query_ids, query_mask, response_ids, mask, logprobs, ref_logprobs, values, entropy, scores, has_eos, group_ids.to(self.device))

    def advantages(self, ro: Rollout):
        """Shaped rewards, advantages and returns of a rollout (chapters 4, 5 and 10)."""
        cfg = self.config
        scores = adjust_scores(ro.scores, ro.has_eos, cfg.missing_eos_penalty, cfg.score_norm)
        beta = self.kl_ctl.value if cfg.kl_in == "reward" else 0.0
        rewards = shape_rewards(scores, ro.logprobs, ro.ref_logprobs, ro.mask, beta, cfg.kl_estimator, cfg.score_clip)
        advantages, returns = self.estimator(
            rewards, ro.mask, values=ro.values, group_ids=ro.group_ids, gamma=cfg.gamma, lam=cfg.lam
        )
        if cfg.whiten_advantages:
            advantages = masked_whiten(advantages, ro.mask)
        return rewards, advantages, returns

    def _loss(self, ro: Rollout, idx: torch.Tensor, advantages, returns):
        """Loss of one micro-batch `idx` of the rollout, and its metrics."""
        cfg = self.config
        q, qm, r, m = ro.query_ids[idx], ro.query_mask[idx], ro.response_ids[idx], ro.mask[idx]
        logits, values = response_logits(self.policy, q, qm, r, m)
        logprobs = logprobs_from_logits(logits, r, cfg.temperature)
        if self.penalty_ctl is not None:
            loss, metrics = kl_penalized_policy_loss(logprobs, ro.logprobs[idx], advantages[idx], m, self.penalty_ctl.value, cfg.loss_agg)
        else:
            loss, metrics = clipped_policy_loss(
                logprobs, ro.logprobs[idx], advantages[idx], m, cfg.clip_eps, cfg.clip_eps_high, cfg.dual_clip, cfg.loss_agg
            )
        metrics["loss/policy"] = loss.detach()
        if self.critic is not None:
            values = critic_values(self.critic, q, qm, r, m)
        if ro.values is not None:
            vf_loss, v_metrics = clipped_value_loss(values.float(), ro.values[idx], returns[idx], m, cfg.value_clip, cfg.loss_agg)
            loss = loss + cfg.vf_coef * vf_loss
            metrics.update(v_metrics)
            metrics["loss/value"] = vf_loss.detach()
        if cfg.entropy_coef > 0:
            ent = aggregate_loss(entropy_from_logits(logits, cfg.temperature), m, cfg.loss_agg)
            loss = loss - cfg.entropy_coef * ent
            metrics["loss/entropy"] = ent.detach()
        if cfg.kl_in == "loss":
            kl = aggregate_loss(kl_penalty(logprobs, ro.ref_logprobs[idx], cfg.kl_estimator), m, cfg.loss_agg)
            loss = loss + self.kl_ctl.value * kl
            metrics["loss/kl"] = kl.detach()
        return loss, metrics

    def _no_sync(self, last: bool):
        """Skip DDP's gradient all-reduce on every micro-batch but the last of a minibatch."""
        if last or self.accelerator.num_processes == 1:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for model in (self.policy, self.critic):
            if model is not None:
                stack.enter_context(self.accelerator.no_sync(model))
        return stack

    def update(self, ro: Rollout, advantages, returns) -> dict[str, float]:
        """ppo_epochs passes of shuffled minibatches; one optimizer step per minibatch.

        An optimizer step whose gradient norm is not finite is skipped (the weights and the
        optimizer state stay as they were); `self._skipped` records why.
        """
        cfg = self.config
        n, mb, ga = len(ro), cfg.minibatch_size, cfg.gradient_accumulation_steps
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        micro = mb // (ga * world)
        collected: dict[str, list[torch.Tensor]] = {}
        params = self._trained_parameters()
        shuffle = self._generator("shuffle")
        self._modes(training=True)
        steps, overflows, stop = 0, 0, False
        for _ in range(cfg.ppo_epochs):
            if stop:
                break
            order = torch.randperm(n, generator=shuffle).to(self.device)
            for start in range(0, n, mb):
                # this process's micro-batches of the global minibatch
                mine = order[start : start + mb][rank * ga * micro : (rank + 1) * ga * micro]
                step_metrics: dict[str, list[torch.Tensor]] = {}
                for j in range(ga):
                    with self._no_sync(last=j == ga - 1):
                        loss, metrics = self._loss(ro, mine[j * micro : (j + 1) * micro], advantages, returns)
                        self.accelerator.backward(loss / ga)
                    for key, value in metrics.items():
                        step_metrics.setdefault(key, []).append(value)
                # The norm is taken after DDP's all-reduce, so every process sees the same value
                # and makes the same skip decision.
                norm = self.accelerator.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf)
                norm = torch.as_tensor(norm).detach().float().to(self.device)
                # Early stop on a target KL (Stable-Baselines3's `target_kl`; CleanRL and Spinning
                # Up check once per epoch): this minibatch's approx KL, measured before its step,
                # says how far the steps so far moved the policy from the one that sampled the
                # batch. Past target_kl, no further step is taken on this batch. On the tiny model,
                # updates that moved it up to 24 nats per token without this made the next
                # rollout stop ending its responses (the KL spikes of the default run). The first
                # minibatch is on-policy (approx KL 0), so every update takes at least one step.
                kl = torch.zeros_like(norm)
                if cfg.target_kl is not None and step_metrics.get("policy/approx_kl"):
                    kl = torch.stack([v.float() for v in step_metrics["policy/approx_kl"]]).mean()
                    if world > 1:
                        kl = self.accelerator.reduce(kl, reduction="mean")  # all processes decide alike
                # The one read-back to the host per minibatch: both decisions at once.
                kl_value, norm_value = torch.stack([kl, norm]).tolist()
                if cfg.target_kl is not None and kl_value > cfg.target_kl:
                    self._discard_gradients()
                    stop = True
                    break
                if not math.isfinite(norm_value):
                    self._discard_gradients()
                    bad = [k for k, vs in step_metrics.items() if not all(bool(torch.isfinite(v).all()) for v in vs)]
                    if self.accelerator.scaler is not None and not bad:
                        # fp16: the loss scale was too large for these gradients. The scaler has
                        # just lowered it; this is how fp16 training normally starts, not a
                        # failed update.
                        overflows += 1
                        continue
                    self._skipped.append(("gradients", "policy/grad_norm", f"{norm_value}" + (f"; non-finite: {', '.join(bad)}" if bad else "")))
                    continue
                for key, values in step_metrics.items():
                    collected.setdefault(key, []).extend(values)
                collected.setdefault("policy/grad_norm", []).append(norm)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                steps += 1
        keys = sorted(collected)
        out = {}
        if keys:
            means = torch.stack([torch.stack([v.float() for v in collected[k]]).mean() for k in keys])
            if world > 1:
                means = self.accelerator.reduce(means, reduction="mean")
            out = dict(zip(keys, means.tolist()))
        out["policy/steps"] = float(steps)
        if self.accelerator.scaler is not None:
            out["train/overflow_steps"] = float(overflows)
        return out

    def _trained_parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def _weight_norm(self) -> torch.Tensor:
        """The L2 norm of all trained weights, as a 0-dim tensor (no read-back)."""
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach().float()) for p in self._trained_parameters()]))

    def _discard_gradients(self) -> None:
        """Drop this minibatch's gradients without an optimizer step.

        Under fp16 the grad scaler has already unscaled them (in `clip_grad_norm_`) and refuses
        to unscale again until `update()`; `update()` also lowers the scale when they overflowed.
        """
        if self.accelerator.scaler is not None:
            self.accelerator.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def _rollout_problems(self, ro: Rollout) -> list[tuple[str, str, str]]:
        """(phase, metric, detail) for every non-finite quantity of a rollout."""
        real = ro.mask.bool()
        named = {"rollout/logprobs": ro.logprobs, "rollout/ref_logprobs": ro.ref_logprobs, "rollout/values": ro.values}
        named = {k: v for k, v in named.items() if v is not None}
        # One read-back for the whole batch: is the mask 0/1 with a real token in every row, and
        # is each quantity finite (on real tokens)? The advantages and the update then run
        # without per-call value checks (`skip_value_checks`).
        mask_ok = ((ro.mask == 0) | (ro.mask == 1)).all() & real.any(dim=1).all() & (real.sum() >= (2 if self.config.whiten_advantages else 1))
        finite = torch.stack([mask_ok, torch.isfinite(ro.scores).all()] + [(torch.isfinite(v) | ~real).all() for v in named.values()]).tolist()
        if not finite.pop(0):
            raise ValueError(
                "the rollout's response mask must hold only 0 and 1, with at least one real token in every row "
                "(and two in all to whiten the advantages: with rollout_batch_size = 1, set whiten_advantages to false)"
            )
        found = []
        if not finite[0]:
            bad = ~torch.isfinite(ro.scores)
            rows = torch.nonzero(bad).flatten()[:5].tolist()
            found.append(("reward", "reward/score_mean", f"reward {self.reward_name} returned {ro.scores[bad][:5].tolist()} for responses {rows}"))
        for name, ok in zip(named, finite[1:]):
            if not ok:
                found.append(("rollout", name, "non-finite on real response tokens"))
        return found

    def step(self) -> dict[str, float]:
        """One PPO iteration; returns its metrics (fixed names, see the README).

        Non-finite rewards, log-probs or values skip the whole update; non-finite gradients skip
        that optimizer step. Either way a warning names the phase and the metric, and once
        `max_bad_updates` updates have been skipped a `NonFiniteError` stops the run.
        """
        cfg = self.config
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        ro = self.rollout(self.next_prompts())
        t1 = time.perf_counter()
        beta = self.kl_ctl.value
        self._skipped = self._rollout_problems(ro)
        norm_before = self._weight_norm()
        if self._skipped:
            metrics, advantages = {}, None
        else:
            with skip_value_checks():  # the rollout was checked once, just above
                rewards, advantages, returns = self.advantages(ro)
                metrics = self.update(ro, advantages, returns)
        t2 = time.perf_counter()

        kl_per_seq = (kl_penalty(ro.logprobs, ro.ref_logprobs, "k1") * ro.mask).sum(1)
        with skip_value_checks():  # the mask was checked in `_rollout_problems`
            stats = {
                "reward/score_mean": ro.scores.mean(),
                "reward/score_std": ro.scores.std() if len(ro) > 1 else torch.zeros(()),
                "reward/eos_fraction": ro.has_eos.float().mean(),
                "objective/kl": kl_per_seq.mean(),
                "objective/entropy": masked_mean(ro.entropy, ro.mask),
                "objective/non_score_reward": (-beta * kl_per_seq).mean() if cfg.kl_in == "reward" else torch.zeros(()),
                "objective/rlhf_reward": (ro.scores - beta * kl_per_seq).mean(),
                "response/length_mean": ro.mask.sum(1).float().mean(),
                "advantages/mean": masked_mean(advantages, ro.mask) if advantages is not None else torch.full((), math.nan),
                "tokens": ro.mask.sum().float(),
                # after the update: a learning rate far too large leaves nan, inf or exploded weights
                "weight_norm_before": norm_before,
                "weight_norm_after": self._weight_norm(),
            }
        # one read-back for all of them
        stats = dict(zip(stats, torch.stack([v.detach().float().to(self.device) for v in stats.values()]).tolist()))
        n_tokens = stats.pop("tokens")
        norms = stats.pop("weight_norm_before"), stats.pop("weight_norm_after")
        mean_kl = stats["objective/kl"]
        bad_iteration = bool(self._skipped)
        if not bad_iteration:
            if self.penalty_ctl is not None and "policy/approx_kl" in metrics:  # absent if no step was taken (fp16 overflows)
                metrics["policy/penalty_beta"] = self.penalty_ctl.value
                self.penalty_ctl.update(metrics["policy/approx_kl"])
            self.kl_ctl.update(mean_kl, len(ro))
        self.iteration += 1
        metrics.update(
            {
                "iteration": self.iteration,
                **stats,
                "kl/coef": beta,
                "train/skipped_updates": float(bad_iteration),
                "time/rollout": t1 - t0,
                "time/update": t2 - t1,
                "perf/tokens_per_s": n_tokens / max(t2 - t0, 1e-9),
                "perf/peak_memory_mb": self._peak_memory_mb(),
                "lr": self.scheduler.get_last_lr()[0],
            }
        )
        self._last_rollout = ro
        broken = _broken_weights(*norms)
        if broken:
            last = ckpt.list_checkpoints(self.output_dir / "checkpoints")
            where = f"; the newest checkpoint is {str(last[0])!r}" if last else ""
            err = NonFiniteError(
                f"iteration {self.iteration}: {broken} (learning_rate = {cfg.learning_rate:g} is probably far too "
                f"large). Stopping; the final policy is not saved{where}"
            )
            err.metrics = metrics
            raise err
        if bad_iteration:
            self.bad_updates += 1
            phase, metric, detail = self._skipped[0]
            message = (
                f"iteration {self.iteration}: update skipped ({self.bad_updates} of at most {cfg.max_bad_updates}): "
                f"non-finite {phase} ({metric}: {detail})"
            )
            if self.bad_updates >= cfg.max_bad_updates:
                last = ckpt.list_checkpoints(self.output_dir / "checkpoints")
                where = f"; the newest checkpoint is {str(last[0])!r} (written when its iteration's weights and metrics were finite)" if last else ""
                err = NonFiniteError(f"{message}. Stopping: PPOConfig.max_bad_updates = {cfg.max_bad_updates} reached{where}")
                err.metrics = metrics
                raise err
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return metrics

    def _peak_memory_mb(self) -> float:
        """This iteration's peak on CUDA (the counter is reset when `step` starts, so evaluation
        and checkpointing in between count for neither), the largest over the processes; on a
        CPU the process's peak since it started (it cannot be reset)."""
        peak = peak_memory_mb(self.device)
        if self.accelerator.num_processes > 1:
            peak = self.accelerator.gather(torch.tensor([peak], device=self.device)).max().item()
        return peak

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, n: int | None = None, seed: int | None = None) -> list[dict]:
        """Sample one response for each of the first `n` eval prompts and score it.

        Uses its own random draws (from `seed`, default config.seed), so evaluating does not
        change training, and the same prompt gets the same draws at every evaluation.
        """
        cfg = self.config
        prompts = self.eval_prompts[: n or cfg.eval_prompts]
        draws = torch.Generator().manual_seed((cfg.seed if seed is None else seed) * 8 + _STREAMS["eval"])
        uniforms = torch.rand(len(prompts), cfg.max_new_tokens, generator=draws)
        stop_ids = [] if cfg.ignore_eos else self.stop_ids
        self._modes(training=False)
        with self.accelerator.autocast():
            _, _, response_ids, _ = generate(self.lm, self.tokenizer, prompts, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, stop_ids, self.device, uniforms=uniforms)
        responses = self.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        scores = check_scores(self.reward_fn(prompts, responses), len(prompts), f"reward {self.reward_name}", finite=False)
        return [{"iteration": self.iteration, "prompt": p, "response": r, "score": s} for p, r, s in zip(prompts, responses, scores.tolist())]

    def train(self, iterations: int | None = None) -> list[dict]:
        """Run `iterations` PPO iterations (default: the rest of `total_iterations`)."""
        from tqdm import tqdm

        cfg = self.config
        total = iterations if iterations is not None else cfg.total_iterations - self.iteration
        if not getattr(self, "_output_ready", False):
            self._prepare_output_dir()
        if cfg.report_to and not getattr(self, "_trackers_started", False):
            self.accelerator.init_trackers("ppo_lab", config={k: v for k, v in cfg.to_dict().items() if v is not None})
            self._trackers_started = True
        bar = tqdm(range(total), desc="ppo", disable=not cfg.progress_bar or not self.accelerator.is_main_process, dynamic_ncols=True)
        for _ in bar:
            try:
                metrics = self.step()
            except NonFiniteError as err:
                if getattr(err, "metrics", None) is not None:  # the failed iteration's metrics are kept
                    self._log(err.metrics)
                raise
            if cfg.eval_interval and self.iteration % cfg.eval_interval == 0:
                samples = self.evaluate()
                metrics["eval/score_mean"] = sum(s["score"] for s in samples) / len(samples)
                self._append("samples.jsonl", samples)
            self._log(metrics)
            bar.set_postfix(score=f"{metrics['reward/score_mean']:.3f}", kl=f"{metrics['objective/kl']:.3f}")
            if cfg.save_interval and self.iteration % cfg.save_interval == 0 and not metrics["train/skipped_updates"]:
                self.save_checkpoint()
        if self.iteration >= cfg.total_iterations:
            self.save(self.output_dir / "policy")
        return self.history

    def _log(self, metrics: dict) -> None:
        self.history.append(metrics)
        if self.iteration % self.config.log_interval == 0:
            self._append("metrics.jsonl", [metrics])
            if self.config.report_to:
                self.accelerator.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=self.iteration)

    def _check_output_dir(self) -> None:
        """A fresh run needs an output_dir it can write and that holds no other run (unless
        overwrite_output_dir); both are checked before anything is loaded."""
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise ValueError(f"output_dir {str(self.output_dir)!r} is a file, not a folder")
        held = [n for n in RUN_FILES[:4] if (self.output_dir / n).exists()]
        if held and not self.config.overwrite_output_dir:
            raise ValueError(
                f"output_dir {str(self.output_dir)!r} already holds a run ({held[0]}); choose another "
                "output_dir, set overwrite_output_dir to replace it, or set resume_from to continue it"
            )
        if self.accelerator.is_main_process:
            try:
                self.output_dir.mkdir(parents=True, exist_ok=True)
                probe = self.output_dir / f".write-test-{os.getpid()}"
                probe.write_text("")
                probe.unlink()
            except OSError as err:
                raise ValueError(f"output_dir {str(self.output_dir)!r} cannot be written: {err.strerror or err}") from None

    def _prepare_output_dir(self) -> None:
        """A fresh run never appends to (or silently deletes) another run's files; a resumed
        run keeps its logs up to the checkpoint and drops what came after it."""
        logs = [self.output_dir / n for n in ("metrics.jsonl", "samples.jsonl") if (self.output_dir / n).exists()]
        if self.iteration == 0 and self.resumed_from is None:
            self._check_output_dir()
            self.accelerator.wait_for_everyone()  # every process checked before the main one writes
            if self.accelerator.is_main_process:
                # Overwriting removes *everything* of the old run: its checkpoints left in place
                # would be resumed from, or would push the new run's out under keep_checkpoints.
                for path in [self.output_dir / n for n in RUN_FILES] + list(self.output_dir.glob("policy.*-*")):
                    if path.is_dir():
                        shutil.rmtree(path)
                    elif path.exists():
                        path.unlink()
        elif self.accelerator.is_main_process:
            for path in logs:
                rows = [line for line in path.read_text().splitlines() if line.strip()]
                kept = [row for row in rows if _iteration_of_row(row) <= self.iteration]
                path.write_text("".join(row + "\n" for row in kept))
        if self.accelerator.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(_yaml(self.config.to_dict()))
            run_file = self.output_dir / "run.json.tmp"
            run_file.write_text(json.dumps({"run_id": self.run_id}))
            os.replace(run_file, self.output_dir / "run.json")
            ckpt.remove_partial(self.output_dir / "checkpoints")
            # a final save that was killed: between its two renames the previous policy is
            # policy.old-*, and it is put back; a half-written policy.tmp-* is removed
            old = sorted(self.output_dir.glob("policy.old-*"))
            if old and not (self.output_dir / "policy").exists():
                old[0].rename(self.output_dir / "policy")
            for stale in list(self.output_dir.glob("policy.tmp-*")) + list(self.output_dir.glob("policy.old-*")):
                shutil.rmtree(stale, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._output_ready = True

    # ------------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        """Save the policy and tokenizer with `save_pretrained` (loadable as a hub model).

        A LoRA policy is saved merged (base + adapter), so the folder loads without peft.
        """
        from safetensors import SafetensorError

        folder = Path(folder)
        if self.accelerator.is_main_process:
            # Written next to its final name and renamed when complete, like a checkpoint: a
            # process killed while saving leaves the previous folder (or none), never half of one.
            tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                lm = self.lm
                if self.config.lora_r > 0:
                    from .lora import save_lora

                    save_lora(lm, tmp, merged=True)
                else:
                    with _quiet_transformers():
                        lm.save_pretrained(tmp)
                with _quiet_transformers():
                    self.tokenizer.save_pretrained(tmp)
            except (OSError, RuntimeError, SafetensorError) as err:  # a full disk, a permission
                shutil.rmtree(tmp, ignore_errors=True)
                reason = getattr(err, "strerror", None) or str(err).strip().splitlines()[0]
                raise OSError(f"could not save the policy to {str(folder)!r} ({reason}); nothing was written there") from err
            if folder.exists():
                old = folder.with_name(f"{folder.name}.old-{os.getpid()}")
                folder.rename(old)
                tmp.rename(folder)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(folder)
        self.accelerator.wait_for_everyone()
        return folder

    def _state(self) -> dict:
        import numpy as np

        np_state = np.random.get_state()
        py_state = random.getstate()
        return {
            "iteration": self.iteration,
            "bad_updates": self.bad_updates,
            "kl_ctl": self.kl_ctl.state_dict(),
            "penalty_ctl": self.penalty_ctl.state_dict() if self.penalty_ctl is not None else None,
            "prompt_order": list(self._prompt_order),
            "prompt_rng": _jsonable(self._prompt_rng.getstate()),
            "python_random": _jsonable(py_state),
            "numpy_random": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "history": self.history,
            "config": self.config.to_dict(),
            "run_id": self.run_id,
        }

    def save_checkpoint(self) -> Path:
        """Write a full checkpoint of the run to output_dir/checkpoints (see `ppo_lab.checkpoint`)."""
        root = self.output_dir / "checkpoints"
        path = root / ckpt.checkpoint_name(self.iteration)
        if self.accelerator.is_main_process:
            tensors = {"policy": self._bare(self.policy).state_dict()}
            if self.critic is not None:
                tensors["critic"] = self._bare(self.critic).state_dict()
            rng = {"torch": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
            tensors["rng"] = rng
            objects = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
            path = ckpt.save_checkpoint(root, self.iteration, tensors, objects, self._state(), keep=self.config.keep_checkpoints)
        self.accelerator.wait_for_everyone()
        return path

    def resume(self, where: str | Path) -> Path:
        """Load a checkpoint: a checkpoint folder, or "latest" in output_dir/checkpoints.

        A checkpoint that fails verification is named in a warning and the previous one in the
        same folder is used instead; with none left, ValueError.
        """
        import numpy as np

        root = self.output_dir / "checkpoints" if str(where) == "latest" else Path(where).parent
        if str(where) != "latest":
            try:
                ckpt.verify_checkpoint(where)
                path = Path(where)
            except ckpt.CheckpointError as err:
                older = [p for p in ckpt.list_checkpoints(root) if _iteration_of(p) < _iteration_of(Path(where))]
                warnings.warn(f"{err}; trying the previous checkpoint", stacklevel=2)
                path = ckpt.latest_checkpoint_from(older)
        else:
            path = ckpt.latest_checkpoint(root)
        if path is None:
            raise ValueError(f"no valid checkpoint to resume from in {str(root)!r} (resume_from = {str(where)!r})")
        tensors, objects, state = ckpt.load_checkpoint(path)
        self._check_resume_config(state["config"], path)
        # checkpoints of compiled runs written before the wrapper was stripped on save
        tensors = {k: {n.replace("_orig_mod.", ""): t for n, t in sd.items()} if k in ("policy", "critic") else sd for k, sd in tensors.items()}
        folder_run = self.output_dir / "run.json"
        try:
            folder_run_id = json.loads(folder_run.read_text()).get("run_id") if folder_run.exists() else None
        except (ValueError, AttributeError):
            raise ValueError(f"{str(folder_run)!r} is not readable JSON; delete it if output_dir holds only this checkpoint's run") from None
        if state.get("run_id") and folder_run_id is not None and folder_run_id != state["run_id"]:
            raise ValueError(
                f"checkpoint {str(path)!r} belongs to another run than the one in output_dir {str(self.output_dir)!r} "
                "(its run.json names a different run); resume into the checkpoint's own output_dir"
            )
        if self.critic is not None and "critic" not in tensors:
            raise ValueError(f"checkpoint {str(path)!r} has no critic, but this run uses a separate critic")
        try:
            self._bare(self.policy).load_state_dict(tensors["policy"])
            if self.critic is not None:
                self._bare(self.critic).load_state_dict(tensors["critic"])
            self.optimizer.load_state_dict(objects["optimizer"])
        except (RuntimeError, ValueError) as err:
            first = str(err).strip().splitlines()
            detail = next((line.strip() for line in first if "size mismatch" in line or "Missing" in line or "Unexpected" in line), first[0] if first else "")
            detail = detail if len(detail) <= 240 else detail[:240] + " ..."
            raise ValueError(f"checkpoint {str(path)!r} does not fit the models of this configuration: {detail}") from err
        self.run_id = state.get("run_id", self.run_id)
        self.scheduler.load_state_dict(objects["scheduler"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if self.penalty_ctl is not None and state["penalty_ctl"] is not None:
            self.penalty_ctl.load_state_dict(state["penalty_ctl"])
        self.iteration, self.bad_updates = state["iteration"], state["bad_updates"]
        self.history = state["history"]
        self._prompt_order = list(state["prompt_order"])
        self._prompt_rng.setstate(_tupled(state["prompt_rng"]))
        random.setstate(_tupled(state["python_random"]))
        kind, keys, *rest = state["numpy_random"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
        torch.set_rng_state(tensors["rng"]["torch"])
        if torch.cuda.is_available():
            cuda = [tensors["rng"][k] for k in sorted(tensors["rng"]) if k.startswith("cuda")]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
        self.resumed_from = path
        return path

    def _check_resume_config(self, saved: dict, path: Path) -> None:
        """Warn when the run being resumed was configured differently where it matters."""
        free = {"total_iterations", "resume_from", "output_dir", "overwrite_output_dir", "progress_bar", "log_interval", "eval_interval", "eval_prompts", "save_interval", "keep_checkpoints", "max_bad_updates", "report_to"}
        now = self.config.to_dict()
        changed = sorted(k for k in now if k not in free and k in saved and saved[k] != now[k])
        if changed:
            detail = ", ".join(f"{k}: {saved[k]!r} -> {now[k]!r}" for k in changed)
            warnings.warn(f"resuming {str(path)!r} with a different configuration ({detail}); the run will not match an unbroken one", stacklevel=3)

    def _append(self, name: str, rows: list[dict]) -> None:
        if not self.accelerator.is_main_process:
            return
        with open(self.output_dir / name, "a") as fh:
            for row in rows:
                fh.write(json.dumps({k: _json_value(v) for k, v in row.items()}) + "\n")


def _iteration_of_row(row: str) -> float:
    """The iteration of a metrics or samples row; a torn row (a run killed mid-write) sorts last."""
    try:
        return json.loads(row).get("iteration", 0)
    except ValueError:
        return math.inf


def _iteration_of(path: Path) -> int:
    digits = "".join(ch for ch in path.name.split(".")[0] if ch.isdigit())
    return int(digits) if digits else -1


def _jsonable(state):
    """random.getstate() -> nested lists (JSON has no tuples)."""
    return [list(x) if isinstance(x, tuple) else x for x in state]


def _tupled(state):
    return tuple(tuple(x) if isinstance(x, list) else x for x in state)


# An update that multiplies the trained weights' norm by more than this has exploded: ordinary
# updates change it by well under 1% (a learning rate of 5e4 multiplies it by about 10^5).
WEIGHT_GROWTH_LIMIT = 10.0


def _broken_weights(before: float, after: float) -> str | None:
    """What is wrong with the weights after an update, judged from their norm before and after."""
    if not math.isfinite(after):
        return "the weights are nan or inf after the update"
    if before > 0 and after > WEIGHT_GROWTH_LIMIT * before:
        return f"the update multiplied the norm of the trained weights by {after / before:.3g} (from {before:.4g} to {after:.4g}): they exploded"
    return None


def check_distributed_backend(kind) -> None:
    """Refuse the accelerate backends under which this trainer is not known to be correct.

    One process, and DDP over several (`accelerate launch --multi_gpu`, or CPU processes),
    are what runs: tests/test_distributed.py checks that 2 processes compute what 1 does.
    FSDP and DeepSpeed need more than a wrapper here (the optimizer built after `prepare`,
    sharded checkpoints, a global gradient norm, DeepSpeed's own optimizer step inside
    `backward`), and none of it could be run and checked, so they are refused rather than
    allowed to train silently wrong.
    """
    name = getattr(kind, "value", str(kind))
    if name == "NO" or name.startswith("MULTI_"):
        return
    raise ValueError(
        f"accelerate's distributed type {name} is not supported by ppo_lab: it runs on one device, or on "
        "several with DDP (accelerate launch --multi_gpu). FSDP and DeepSpeed are refused because their "
        "optimizer, checkpoint and gradient-clipping paths are not implemented or tested in ppo_lab; to fit a "
        "larger model on each GPU use lora_r, gradient_checkpointing and precision: bf16"
    )


def enable_checkpointing(model) -> None:
    """Turn on activation (gradient) checkpointing in a transformers model, non-reentrant:
    that variant works with frozen inputs (LoRA) and is inactive in no-grad generation."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def peak_memory_mb(device) -> float:
    """Peak GPU memory allocated on CUDA (since the last reset), else the process's peak
    resident memory since it started, in MB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _json_value(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # strict JSON has no nan
    return v


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)
