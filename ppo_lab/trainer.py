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
"""

from __future__ import annotations

import json
import math
import random
import resource
import time
from pathlib import Path

import torch

from .aggregation import aggregate_loss
from .clipping import clipped_policy_loss, kl_penalized_policy_loss
from .config import PPOConfig
from .estimators import get_advantage_estimator
from .kl import kl_penalty
from .kl_control import AdaptiveKLController, FixedKLController, PPOPenaltyKLController
from .logprobs import entropy_from_logits, logprobs_from_logits
from .masked import masked_mean, masked_whiten
from .models import (
    PolicyWithValueHead,
    _quiet_transformers,
    context_length,
    load_critic,
    load_policy,
    load_tokenizer,
    make_reference,
)
from .rewards import check_scores, load_reward
from .rollout import Rollout, critic_values, generate, response_logits, score_tokens
from .shaping import adjust_scores, shape_rewards
from .value import clipped_value_loss


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
        self.accelerator = Accelerator(
            cpu=not torch.cuda.is_available(),
            mixed_precision="no" if cfg.precision == "fp32" else cfg.precision,
            log_with=log_with,
            project_dir=cfg.output_dir,
        )
        cfg.check_divisibility(self.accelerator.num_processes)
        self.device = self.accelerator.device

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
        self.reward_name = getattr(self.reward_fn, "__qualname__", type(self.reward_fn).__name__)

        # --- the four roles -------------------------------------------------------------
        self.tokenizer = tokenizer or load_tokenizer(cfg.tokenizer or cfg.policy_model, cfg.trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"
        lm = policy if policy is not None else load_policy(cfg.policy_model, cfg.trust_remote_code)
        self.stop_ids = [self.tokenizer.eos_token_id]
        if cfg.stop_token is not None:
            stop = self.tokenizer.convert_tokens_to_ids(cfg.stop_token)
            if stop is None or stop == self.tokenizer.unk_token_id:
                raise ValueError(f"PPOConfig.stop_token = {cfg.stop_token!r} is not a token of the tokenizer")
            self.stop_ids.append(stop)
        self._check_prompt_lengths(lm)
        self.reference = make_reference(lm).to(self.device)
        if cfg.critic == "shared":
            self.policy = PolicyWithValueHead(lm)
            self.critic = None
        elif cfg.critic == "none":
            self.policy, self.critic = lm, None
        else:
            self.policy = lm
            self.critic = load_critic(cfg.critic_model or cfg.policy_model, cfg.trust_remote_code)

        # --- optimisation ---------------------------------------------------------------
        params = list(self.policy.parameters()) + (list(self.critic.parameters()) if self.critic is not None else [])
        self.optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        steps_per_iteration = cfg.ppo_epochs * (cfg.rollout_batch_size // cfg.minibatch_size)
        from transformers import get_scheduler

        self.scheduler = get_scheduler(
            {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.lr_schedule],
            self.optimizer,
            num_warmup_steps=cfg.warmup_steps,
            num_training_steps=cfg.total_iterations * steps_per_iteration,
        )
        if self.critic is not None:
            self.policy, self.critic, self.optimizer, self.scheduler = self.accelerator.prepare(self.policy, self.critic, self.optimizer, self.scheduler)
        else:
            self.policy, self.optimizer, self.scheduler = self.accelerator.prepare(self.policy, self.optimizer, self.scheduler)
        if cfg.kl_control == "adaptive":
            self.kl_ctl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
        else:
            self.kl_ctl = FixedKLController(cfg.kl_coef)
        self.estimator = get_advantage_estimator(cfg.advantage_estimator)
        # PPO-penalty's beta (KL to the *old* policy) is separate from the reference-KL coefficient.
        self.penalty_ctl = PPOPenaltyKLController(cfg.penalty_beta, cfg.penalty_kl_target) if cfg.policy_loss == "kl_penalty" else None

        # --- bookkeeping ----------------------------------------------------------------
        self.iteration = 0
        self.history: list[dict] = []
        self._prompt_order: list[int] = []
        self._prompt_rng = random.Random(cfg.seed)
        self.output_dir = Path(cfg.output_dir)

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

    @property
    def lm(self):
        """The bare causal LM inside the (possibly wrapped) policy, for generation and saving."""
        policy = self.accelerator.unwrap_model(self.policy)
        return policy.lm if isinstance(policy, PolicyWithValueHead) else policy

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

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, prompts: list[str]) -> Rollout:
        """Sample `responses_per_prompt` responses per prompt and score them."""
        cfg, k = self.config, self.config.responses_per_prompt
        repeated = [p for p in prompts for _ in range(k)]
        group_ids = torch.arange(len(prompts)).repeat_interleave(k)
        self.policy.eval()
        query_ids, query_mask, response_ids, mask = generate(
            self.lm, self.tokenizer, repeated, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, self.stop_ids, self.device
        )
        logprobs, ref_logprobs, values, entropy = score_tokens(
            self.policy, self.reference, self.critic, query_ids, query_mask, response_ids, mask, cfg.temperature
        )
        responses = self.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        scores = check_scores(self.reward_fn(repeated, responses), len(repeated), f"reward {self.reward_name}").to(self.device)
        has_eos = torch.isin(response_ids, torch.tensor(self.stop_ids, device=self.device)).any(dim=1)
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

    def update(self, ro: Rollout, advantages, returns) -> dict[str, float]:
        """ppo_epochs passes of shuffled minibatches; one optimizer step per minibatch."""
        cfg = self.config
        n, mb, ga = len(ro), cfg.minibatch_size, cfg.gradient_accumulation_steps
        micro = mb // ga
        collected: dict[str, list[torch.Tensor]] = {}
        self.policy.train()
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(n, device=self.device)
            for start in range(0, n, mb):
                minibatch = order[start : start + mb]
                for j in range(0, mb, micro):
                    loss, metrics = self._loss(ro, minibatch[j : j + micro], advantages, returns)
                    self.accelerator.backward(loss / ga)
                    for key, value in metrics.items():
                        collected.setdefault(key, []).append(value)
                if cfg.max_grad_norm is not None:
                    params = [p for group in self.optimizer.param_groups for p in group["params"]]
                    norm = self.accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                    collected.setdefault("policy/grad_norm", []).append(torch.as_tensor(norm).detach().float())
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        return {k: torch.stack([v.float() for v in vs]).mean().item() for k, vs in collected.items()}

    def step(self) -> dict[str, float]:
        """One PPO iteration; returns its metrics (fixed names, see the README)."""
        cfg = self.config
        t0 = time.perf_counter()
        ro = self.rollout(self.next_prompts())
        t1 = time.perf_counter()
        rewards, advantages, returns = self.advantages(ro)
        beta = self.kl_ctl.value
        metrics = self.update(ro, advantages, returns)
        t2 = time.perf_counter()

        if self.penalty_ctl is not None:
            metrics["policy/penalty_beta"] = self.penalty_ctl.value
            self.penalty_ctl.update(metrics["policy/approx_kl"])
        kl_per_seq = (kl_penalty(ro.logprobs, ro.ref_logprobs, "k1") * ro.mask).sum(1)
        mean_kl = kl_per_seq.mean().item()
        self.kl_ctl.update(mean_kl, len(ro))
        n_tokens = ro.mask.sum().item()
        self.iteration += 1
        metrics.update(
            {
                "iteration": self.iteration,
                "reward/score_mean": ro.scores.mean().item(),
                "reward/score_std": ro.scores.std().item() if len(ro) > 1 else 0.0,
                "reward/eos_fraction": ro.has_eos.float().mean().item(),
                "objective/kl": mean_kl,
                "objective/entropy": masked_mean(ro.entropy, ro.mask).item(),
                "objective/non_score_reward": (-beta * kl_per_seq).mean().item() if cfg.kl_in == "reward" else 0.0,
                "objective/rlhf_reward": (ro.scores - beta * kl_per_seq).mean().item(),
                "response/length_mean": ro.mask.sum(1).mean().item(),
                "advantages/mean": masked_mean(advantages, ro.mask).item(),
                "kl/coef": beta,
                "time/rollout": t1 - t0,
                "time/update": t2 - t1,
                "perf/tokens_per_s": n_tokens / max(t2 - t0, 1e-9),
                "perf/peak_memory_mb": peak_memory_mb(self.device),
                "lr": self.scheduler.get_last_lr()[0],
            }
        )
        self._last_rollout = ro
        return metrics

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, n: int | None = None, seed: int | None = None) -> list[dict]:
        """Sample one response for each of the first `n` eval prompts and score it.

        Runs on its own random stream (seeded), so evaluating does not change training.
        """
        cfg = self.config
        prompts = self.eval_prompts[: n or cfg.eval_prompts]
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(cfg.seed + 1 if seed is None else seed)
            _, _, response_ids, _ = generate(self.lm, self.tokenizer, prompts, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, self.stop_ids, self.device)
        responses = self.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        scores = check_scores(self.reward_fn(prompts, responses), len(prompts), f"reward {self.reward_name}")
        return [{"iteration": self.iteration, "prompt": p, "response": r, "score": s} for p, r, s in zip(prompts, responses, scores.tolist())]

    def train(self, iterations: int | None = None) -> list[dict]:
        """Run `iterations` PPO iterations (default: the rest of `total_iterations`)."""
        from tqdm import tqdm

        cfg = self.config
        total = iterations if iterations is not None else cfg.total_iterations - self.iteration
        if self.iteration == 0:
            self._start_output_dir()
        if cfg.report_to and not getattr(self, "_trackers_started", False):
            self.accelerator.init_trackers("ppo_lab", config={k: v for k, v in cfg.to_dict().items() if v is not None})
            self._trackers_started = True
        bar = tqdm(range(total), desc="ppo", disable=not cfg.progress_bar or not self.accelerator.is_main_process, dynamic_ncols=True)
        for _ in bar:
            metrics = self.step()
            if cfg.eval_interval and self.iteration % cfg.eval_interval == 0:
                samples = self.evaluate()
                metrics["eval/score_mean"] = sum(s["score"] for s in samples) / len(samples)
                self._append("samples.jsonl", samples)
            self.history.append(metrics)
            if self.iteration % cfg.log_interval == 0:
                self._append("metrics.jsonl", [metrics])
                if cfg.report_to:
                    self.accelerator.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=self.iteration)
            bar.set_postfix(score=f"{metrics['reward/score_mean']:.3f}", kl=f"{metrics['objective/kl']:.3f}")
            if cfg.save_interval and self.iteration % cfg.save_interval == 0:
                self.save(self.output_dir / f"policy-{self.iteration}")
        if self.iteration >= cfg.total_iterations:
            self.save(self.output_dir / "policy")
        return self.history

    def _start_output_dir(self) -> None:
        """A fresh run never appends to (or silently deletes) another run's files."""
        old = [self.output_dir / n for n in ("metrics.jsonl", "samples.jsonl") if (self.output_dir / n).exists()]
        if old and not self.config.overwrite_output_dir:
            raise ValueError(
                f"output_dir {str(self.output_dir)!r} already holds a run ({old[0].name}); choose another "
                "output_dir, or set overwrite_output_dir to replace it"
            )
        if self.accelerator.is_main_process:
            for path in old:
                path.unlink()
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(_yaml(self.config.to_dict()))

    def save(self, folder: str | Path) -> Path:
        """Save the policy and tokenizer with `save_pretrained` (loadable as a hub model)."""
        folder = Path(folder)
        if self.accelerator.is_main_process:
            with _quiet_transformers():
                self.lm.save_pretrained(folder)
                self.tokenizer.save_pretrained(folder)
        return folder

    def _append(self, name: str, rows: list[dict]) -> None:
        if not self.accelerator.is_main_process:
            return
        with open(self.output_dir / name, "a") as fh:
            for row in rows:
                fh.write(json.dumps({k: _json_value(v) for k, v in row.items()}) + "\n")


def peak_memory_mb(device) -> float:
    """Peak GPU memory allocated on CUDA, else the process's peak resident memory, in MB."""
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
