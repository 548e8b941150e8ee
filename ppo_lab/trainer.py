"""The PPO trainer: rollout, reward shaping, advantages, clipped updates, repeat.

Chapter 7 (The PPO trainer end to end) reads this file from top to bottom. The loop composes
the pure functions of the earlier chapters and contains no math of its own:

    for each iteration:
        rollout     = sample responses, score tokens with policy / reference / critic  (rollout.py)
        scores      = reward(prompts, responses), adjusted                              (rewards.py, shaping.py)
        rewards     = shape_rewards(scores, old_logprobs, ref_logprobs, mask, kl_coef)  (chapter 5)
        advantages  = estimator(rewards, mask, values, ...)                             (chapters 4, 10)
        for epoch in ppo_epochs, for minibatch in shuffled minibatches:
            loss = ppo_loss(...): policy loss + vf_coef * value loss - entropy bonus    (losses.py)
            backward, clip gradients, optimizer and scheduler step
        KL controller update                                                            (chapter 5)

How it departs from the textbook algorithm, on purpose:
1. The score sits on the last real token; padding never enters GAE (see shaping.py, gae.py).
2. Log-probs are always taken at the sampling temperature, for the policy and the reference.
3. Dropout is off in every model, so the first update step is exactly on-policy (ratio = 1).
4. The KL penalty uses the rollout log-probs (fixed during the update) when it is in the
   reward; with `kl_in="loss"` it is recomputed with gradients at every step (GRPO style).
5. With gradient accumulation and several processes, each micro-batch's aggregated loss is
   weighted by its share of the minibatch's tokens (or sequences), so the gradient is that of
   the whole minibatch however it is split (aggregation.py); a mean of micro-batch means would
   weigh the tokens of short micro-batches more.
6. Every random draw of an iteration (the sampled tokens, the minibatch order) comes from a
   generator seeded by (seed, iteration), and each response's tokens depend only on its own
   draws. So a run split over N processes samples the same responses as one process, and a
   run resumed from a checkpoint continues exactly as the unbroken run would have.
7. Non-finite rewards, losses or gradients never reach the weights: the optimizer step is
   skipped with a warning that names the phase and the metric, and after `max_bad_updates`
   skipped updates the run stops, its last checkpoint untouched.

The pieces live in modules of their own: building the run (build.py), sampling and scoring
(rollout.py), the loss of a micro-batch (losses.py), the metrics and health checks (metrics.py),
several processes (distributed.py), the run's folder (run_output.py) and checkpoints
(checkpoint.py). This file is the loop that composes them.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import uuid
import warnings
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import distributed as dist
from ._checks import NonFiniteError, skip_value_checks
from .aggregation import micro_batch_weight
from .build import PromptStream, build_kl_controllers, build_optimizer, build_roles, build_task, draws, make_accelerator, seed_everything
from .config import PPOConfig
from .disagreements import dropout_on, gae_over_padding, parse_reproduce, score_past_last, whiten_with_padding
from .dynamic_sampling import informative_groups
from .estimators import get_advantage_estimator
from .losses import ppo_loss
from .masked import masked_whiten
from .metrics import CollapseWatch, health_message, mean_metrics, rollout_metrics, rollout_problems, weight_norm, weights_problem
from .models import PolicyWithValueHead
from .rewards import check_scores, reads_token_ids, score_responses
from .rollout import Rollout, cat_rollouts, check_chunkable, critic_values, generate, response_logprobs, score_tokens
from .rollout_correction import correction_weights, gap_metrics
from .run_output import RunOutput, save_policy
from .shaping import adjust_scores, overlong_penalty, reference_normalization, shape_rewards

class PPOTrainer:
    """PPO for a causal LM. Everything not passed in is built from `config`.

    Args:
        config: the `PPOConfig`.
        policy, tokenizer: an already loaded `AutoModelForCausalLM` and its tokenizer (optional).
        reward_fn: a callable (prompts, responses) -> scores, which may also take `ended`
            (see `ppo_lab.rewards`) (optional; default from config).
        train_prompts, eval_prompts: lists of prompt strings (optional; default: the task's).
        gold_fn: a second reward (prompts, responses) -> scores that is measured and never
            trained on: every rollout's mean is logged as `reward/gold_mean`, and evaluation
            samples get a "gold" score. With a learned reward model as `reward_fn` and the
            reward its preference labels came from as `gold_fn`, a run shows over-optimisation
            (chapter 8). (optional)
    """

    def __init__(self, config: PPOConfig, *, policy=None, tokenizer=None, reward_fn=None, train_prompts=None, eval_prompts=None, gold_fn=None):
        self.config = cfg = config
        seed_everything(cfg.seed)
        self.accelerator = make_accelerator(cfg)
        dist.check_distributed_backend(self.accelerator.distributed_type)
        cfg.check_divisibility(self.accelerator.num_processes)
        self.device = self.accelerator.device
        self.output_dir = Path(cfg.output_dir)
        self.out = RunOutput(cfg.output_dir, self.accelerator, cfg.overwrite_output_dir)
        if not cfg.resume_from:
            self.out.check()  # before minutes of loading, not after
        else:
            ckpt.resolve_resume_from(cfg.resume_from, cfg.output_dir)  # a mistyped checkpoint, likewise

        task = build_task(cfg, self.device, train_prompts, eval_prompts, reward_fn)
        self.task = task.builtin  # the built-in task (ppo_lab.tasks), None when prompts and reward were given
        self.train_prompts, self.eval_prompts, self.reward_fn, self.reward_name = task.train_prompts, task.eval_prompts, task.reward_fn, task.reward_name
        roles = build_roles(cfg, task, self.device, policy, tokenizer)
        self.tokenizer, self.reference, self.sampling = roles.tokenizer, roles.reference, roles.sampling
        optimizer, self.scheduler = build_optimizer(cfg, roles.policy, roles.critic)
        models = [m for m in (roles.policy, roles.critic) if m is not None]
        *models, self.optimizer = self.accelerator.prepare(*models, optimizer)
        self.policy, self.critic = models[0], (models[1] if roles.critic is not None else None)
        # Other implementations' choices, for Appendix A only (ppo_lab.disagreements)
        self.reproduce = parse_reproduce(cfg.reproduce)
        if "dropout-on" in self.reproduce:
            for model in models:
                dropout_on(model)
        # the temperature of every log-prob forward: the sampling temperature, unless reproducing the mismatch
        self.score_temperature = 1.0 if "temperature-1-in-scoring" in self.reproduce else cfg.temperature
        if cfg.logprob_chunk_size:  # refuse a model whose logits are not lm_head(hidden), before any training
            ids = self.tokenizer(self.train_prompts[:1], return_tensors="pt", add_special_tokens=False)["input_ids"].to(self.device)
            with self.accelerator.autocast():  # (the head then runs in the forward's precision)
                check_chunkable(self.bare(self.policy), ids)
        self.kl_ctl, self.penalty_ctl = build_kl_controllers(cfg)
        self.estimator = get_advantage_estimator(cfg.advantage_estimator)
        # Old log-probs from the sampling logits save a forward; in half precision the cached
        # and the full forward disagree by ~1e-2 nats, so they are recomputed there, and so they
        # are when the sampler is not the trainer (chapter 9: the decoupled form).
        self.sampler_differs = cfg.sampler_noise > 0 or cfg.sampler_precision != "same"
        same = cfg.precision == "fp32" and not self.sampler_differs and cfg.rollout_correction == "none"
        self.old_logprobs_from = cfg.old_logprobs if cfg.old_logprobs != "auto" else ("sampling" if same else "forward")
        # the sampler's own copy of the weights, perturbed at every rollout (chapter 9's stand-in for an inference engine)
        self.sampler_lm = copy.deepcopy(self.lm).requires_grad_(False) if cfg.sampler_noise > 0 else None
        # a reward model with the policy's tokenizer reads the sampled ids, EOS included (rewards.py)
        self.reward_by_ids = reads_token_ids(self.reward_fn, self.tokenizer)
        if gold_fn is not None and not callable(gold_fn):
            raise TypeError(f"gold_fn must be a callable (prompts, responses) -> scores, got {type(gold_fn).__name__}")
        self.gold_fn = gold_fn
        self.score_gain, self.score_bias = 1.0, 0.0  # reference_score_norm's fixed map (set below)

        self.iteration, self.bad_updates, self.collapse = 0, 0, CollapseWatch()
        self.history: list[dict] = []
        self.prompt_stream = PromptStream(self.train_prompts, cfg.rollout_batch_size // cfg.responses_per_prompt, cfg.seed)
        self.run_id = uuid.uuid4().hex  # a resumed run takes its checkpoint's
        self.resumed_from: Path | None = None
        if cfg.resume_from:
            self.resume(cfg.resume_from)  # (restores the score gain and bias too)
        elif cfg.reference_score_norm != "none":
            self.score_gain, self.score_bias = reference_normalization(self.reference_scores(cfg.reference_score_samples), cfg.reference_score_norm)  # fixed from here on

    # --- helpers ---------------------------------------------------------------------------
    def bare(self, model):
        """`model` without accelerate's wrappers (DDP, torch.compile; the mixed-precision
        forward is kept): what its own attributes, state dict and value head belong to."""
        return self.accelerator.unwrap_model(model, keep_torch_compile=False)

    @property
    def lm(self):
        """The bare causal LM inside the (possibly wrapped) policy, for generation and saving."""
        policy = self.bare(self.policy)
        return policy.lm if isinstance(policy, PolicyWithValueHead) else policy

    def _modes(self, training: bool) -> None:
        """Train mode for the update, eval mode for sampling and scoring. Dropout is off either
        way; the mode matters for gradient checkpointing, which is active in train mode only."""
        for model in (self.policy, self.critic):
            if model is not None:
                model.train(training)

    def _trained_parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def next_prompts(self) -> list[str]:
        """The prompts of the next rollout (see `build.PromptStream`)."""
        return self.prompt_stream.next()

    # --- 1. rollout: sample, score with every model, reward ---------------------------------
    @torch.no_grad()
    def rollout(self, prompts: list[str], attempt: int = 0) -> Rollout:
        """Sample `responses_per_prompt` responses per prompt, score their tokens with the policy,
        the reference and the critic, and the responses with the reward. Each process does its
        share; the returned rollout is the whole batch. Non-finite scores are left for `step`.
        `attempt` > 0 draws other tokens for the extra rollouts of dynamic sampling."""
        k = self.config.responses_per_prompt
        repeated = [p for p in prompts for _ in range(k)]
        lo, hi = dist.shard(self.accelerator, len(repeated))
        mine = repeated[lo:hi]
        uniforms = torch.rand(len(repeated), self.sampling.max_new_tokens, generator=draws(self.config.seed, self.iteration, "sample", attempt))[lo:hi]
        from_sampling = self.old_logprobs_from == "sampling"
        policy = self.bare(self.policy)
        # (a sampler that differs from the trainer has no value head: the values come from a forward)
        value_head = policy.v_head if from_sampling and not self.sampler_differs and isinstance(policy, PolicyWithValueHead) else None
        self._modes(training=False)
        # One autocast region for every forward (the sampling loop calls the bare LM, outside
        # the autocast accelerate wraps the prepared model in): in bf16 the policy and the
        # reference then agree exactly before the first update, and the bf16 copies of the
        # weights are made once per rollout, not once per token.
        with self.accelerator.autocast():
            with self.sampler_autocast():
                # the sampler's log-probs are kept beside the trainer's (computed from the logits each token was drawn from)
                drawn = generate(
                    self.sampler(), self.tokenizer, mine, self.sampling, device=self.device, uniforms=uniforms,
                    with_logprobs=True, with_entropy=from_sampling, value_head=value_head,  # (the entropy of a forward otherwise)
                )
            old_logprobs, ref_logprobs, values, entropy = score_tokens(
                self.policy, self.reference, self.critic, drawn.query_ids, drawn.query_mask, drawn.response_ids, drawn.mask, self.score_temperature,
                old_logprobs=drawn.old_logprobs if from_sampling else None, entropy=drawn.entropy if from_sampling else None,
                values=drawn.values, batch_size=self.config.forward_batch_size, chunk_size=self.config.logprob_chunk_size,
            )
        responses = self.tokenizer.batch_decode(drawn.response_ids, skip_special_tokens=True)
        scores = self.score(mine, responses, drawn).to(self.device)
        has_eos = drawn.ended
        parts = dict(
            responses=responses, query_ids=drawn.query_ids, query_mask=drawn.query_mask, response_ids=drawn.response_ids, mask=drawn.mask,
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, values=values, entropy=entropy, scores=scores, has_eos=has_eos,
            sampler_logprobs=drawn.old_logprobs,
        )
        parts = dist.gather_rollout(self.accelerator, parts, self.tokenizer.pad_token_id)
        group_ids = torch.arange(len(prompts), device=self.device).repeat_interleave(k)
        ro = Rollout(prompts=repeated, group_ids=group_ids, **parts)
        cfg = self.config
        if cfg.rollout_correction != "none":  # (decoupled form only: PPOConfig refuses it with old_logprobs sampling)
            ro.weights = correction_weights(
                ro.old_logprobs, ro.sampler_logprobs, ro.mask, kind=cfg.rollout_correction, level=cfg.rollout_correction_level,
                low=cfg.rollout_correction_low, high=cfg.rollout_correction_high,
            )
        return ro

    def collect(self) -> tuple[Rollout, dict[str, float]]:
        """The rollout of this iteration, and its sampling/* metrics. Without dynamic sampling, one
        rollout of the next prompts. With it (DAPO), rollouts are drawn until `rollout_batch_size`
        responses of informative groups (whose raw scores are not all equal, as verl's default
        `metric: acc`) are in hand, at most `dynamic_sampling_max_rounds` of them. The first
        informative groups make the batch; the ones beyond it are discarded (as in verl), and a
        batch still short is filled with dropped groups, earliest first. Rows of different
        rollouts are padded to a common width after they were scored at their own, so the first
        step's ratio is 1 to float round-off rather than exactly."""
        cfg = self.config
        if not cfg.dynamic_sampling:
            return self.rollout(self.next_prompts()), {}
        k, needed = cfg.responses_per_prompt, cfg.rollout_batch_size // cfg.responses_per_prompt
        kept: list[Rollout] = []  # each round's informative groups that the batch can still use
        dropped: list[Rollout] = []  # and its other groups, as many as could be needed to fill it
        n_kept = n_dropped = drawn = informative = 0
        score_sum = 0.0
        for attempt in range(cfg.dynamic_sampling_max_rounds):
            ro = self.rollout(self.next_prompts(), attempt)
            keep = informative_groups(ro.scores, ro.group_ids).view(-1, k)[:, 0]  # (groups,): a group's responses are adjacent
            drawn, informative = drawn + len(keep), informative + int(keep.sum())
            score_sum += ro.scores.double().sum().item()
            groups = torch.arange(len(ro), device=ro.mask.device).view(-1, k)
            # only the rows that can still be used are kept, the rest of the round is freed
            good, bad = groups[keep][: needed - n_kept], groups[~keep][: needed - n_kept - n_dropped]
            if len(good):
                kept.append(cat_rollouts([(ro, good.flatten())], self.tokenizer.pad_token_id))
            if len(bad):
                dropped.append(cat_rollouts([(ro, bad.flatten())], self.tokenizer.pad_token_id))
            n_kept, n_dropped = n_kept + len(good), n_dropped + len(bad)
            del ro
            if n_kept >= needed:
                break
        fill = needed - n_kept  # groups still missing: the earliest dropped ones
        parts = [(part, torch.arange(len(part), device=part.mask.device)) for part in kept]
        for part in dropped:
            if fill <= 0:
                break
            take = min(fill, len(part) // k)
            parts.append((part, torch.arange(take * k, device=part.mask.device)))
            fill -= take
        batch = cat_rollouts(parts, self.tokenizer.pad_token_id)
        return batch, {
            "sampling/responses": float(drawn * k), "sampling/rounds": float(attempt + 1), "sampling/informative_frac": informative / drawn,
            "sampling/score_mean": score_sum / (drawn * k),
        }

    def sampler(self):
        """The model that samples: the policy, or (sampler_noise > 0) its copy with every weight
        multiplied by 1 + sampler_noise x N(0, 1), drawn for this iteration."""
        if self.sampler_lm is None:
            return self.lm
        noise = draws(self.config.seed, self.iteration, "sampler")
        with torch.no_grad():
            for copied, weight in zip(self.sampler_lm.parameters(), self.lm.parameters()):
                scale = 1 + self.config.sampler_noise * torch.randn(weight.shape, generator=noise)
                copied.copy_(weight * scale.to(weight.device, weight.dtype))
        return self.sampler_lm

    def sampler_autocast(self):
        """bfloat16 autocast around sampling when `sampler_precision` is bf16, else nothing."""
        if self.config.sampler_precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def score(self, prompts: list[str], responses: list[str], drawn) -> torch.Tensor:
        """(B,) raw scores of `drawn` (a `rollout.Sample`) from the reward, checked; nan and inf
        are left for `step`. See `rewards.score_responses` for how the reward is called."""
        raw = score_responses(self.reward_fn, prompts, responses, drawn, self.reward_by_ids)
        return check_scores(raw, len(prompts), f"reward {self.reward_name}", finite=False)

    def gold_scores(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        """(B,) the `gold_fn` scores of this process's responses, checked (finite)."""
        return check_scores(self.gold_fn(prompts, responses), len(prompts), "gold_fn")

    def gold_mean(self, prompts: list[str], responses: list[str]) -> float:
        """The mean gold score of all processes' responses (equal shares per process)."""
        local = self.gold_scores(prompts, responses).double().mean().to(self.device)
        return dist.mean_over_processes(self.accelerator, local).item()

    def reference_scores(self, n: int) -> torch.Tensor:
        """(n,) scores of n reference-policy responses (see `ppo_lab.reference_norm`)."""
        from .reference_norm import reference_scores

        return reference_scores(self, n)

    # --- 2. shape the rewards, estimate the advantages --------------------------------------
    def advantages(self, ro: Rollout):
        """(rewards, advantages, returns), each (B, T): the score on the last token minus the KL
        penalty on every token (chapter 5), then the configured estimator (chapters 4, 10). The
        critic's targets use `critic_lam` when it is set (VAPO's decoupled lambda). With
        `whiten_rewards` the estimator sees the rewards scaled to std 1; the rewards returned
        (and logged) are those before the scaling."""
        cfg = self.config
        raw = ro.scores
        if cfg.overlong_buffer:  # DAPO's soft overlong punishment, by length alone, added to the reward's score
            raw = raw + overlong_penalty(ro.mask.sum(dim=-1), cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty_factor).to(raw.dtype)
        scores = adjust_scores(
            raw, ro.has_eos, cfg.missing_eos_penalty, cfg.score_norm,
            missing_eos_score=cfg.missing_eos_score, gain=self.score_gain, bias=self.score_bias,
        )
        kl_coef = self.kl_ctl.value if cfg.kl_in == "reward" else 0.0
        shaped = shape_rewards(scores, ro.old_logprobs, ro.ref_logprobs, ro.mask, kl_coef, cfg.kl_estimator, cfg.score_clip)
        if "score-past-last" in self.reproduce:
            shaped = score_past_last(shaped, scores.clamp(-cfg.score_clip, cfg.score_clip) if cfg.score_clip is not None else scores, ro.mask)
        rewards = shaped
        if cfg.whiten_rewards:  # std 1, mean kept: the sign of the KL penalty survives (OpenAI 2019)
            rewards = masked_whiten(shaped, ro.mask, shift_mean=False)
        estimator = self.estimator
        if "gae-over-padding" in self.reproduce:
            estimator = lambda rewards, mask, values, gamma, lam, **_: gae_over_padding(rewards, values, mask, gamma, lam)  # noqa: E731
        placed = scores.clamp(-cfg.score_clip, cfg.score_clip) if cfg.score_clip is not None else scores  # the score on the last token
        common = dict(values=ro.values, group_ids=ro.group_ids, scores=placed, gamma=cfg.gamma)
        advantages, returns = estimator(rewards, ro.mask, lam=cfg.lam, **common)
        if cfg.critic_lam is not None and cfg.critic_lam != cfg.lam:
            _, returns = estimator(rewards, ro.mask, lam=cfg.critic_lam, **common)
        counted = ro.mask
        if cfg.overlong_filter and bool(ro.has_eos.any()):  # DAPO: a truncated response adds no policy gradient,
            counted = ro.mask * ro.has_eos.to(ro.mask.dtype)[:, None]  # nor does it shape the whitening
        if cfg.whiten_advantages:
            advantages = whiten_with_padding(advantages, counted) if "whiten-with-padding" in self.reproduce else masked_whiten(advantages, counted)
        if cfg.overlong_filter:
            advantages = advantages * ro.has_eos.to(advantages.dtype)[:, None]
        return shaped, advantages, returns

    @torch.no_grad()
    def first_step_metrics(self) -> dict[str, float]:
        """What the first optimizer step of an update would see, without taking it: a rollout of
        the first `minibatch_size` training prompts, then the loss metrics of that minibatch under
        the current weights in train mode. On-policy (dropout off, one temperature in sampling and
        scoring) every ratio is 1, so policy/ratio_min = ratio_max = 1 and policy/clipfrac = 0,
        up to float round-off (appendices A and C). The weights, the prompt stream and the
        iteration count are left as they were."""
        k = self.config.responses_per_prompt
        ro = self.rollout(self.train_prompts[: max(self.config.minibatch_size // k, 1)])
        _, advantages, returns = self.advantages(ro)
        self._modes(training=True)
        _, metrics = self.minibatch_loss(ro, torch.arange(len(ro), device=self.device), advantages, returns)
        self._modes(training=False)
        return {key: value.item() for key, value in metrics.items()}

    # --- 3. the update: epochs of shuffled minibatches --------------------------------------
    def minibatch_loss(self, ro: Rollout, idx: torch.Tensor, advantages, returns):
        """The loss of the rollout's rows `idx` under the current weights, and its metrics."""
        q, qm, r, m = ro.query_ids[idx], ro.query_mask[idx], ro.response_ids[idx], ro.mask[idx]
        train_policy = self.iteration >= self.config.value_warmup_iterations
        values, logprobs, entropy = None, None, None
        if train_policy or self.critic is None:  # (a value warm-up with a separate critic needs no policy forward)
            chunk = self.config.logprob_chunk_size
            # the chunked LM head runs outside the model's forward, so outside the autocast accelerate gives it
            with self.accelerator.autocast() if chunk else contextlib.nullcontext():
                logprobs, entropy, values = response_logprobs(
                    self.policy, q, qm, r, m, self.score_temperature, chunk_size=chunk, with_entropy=train_policy and self.config.entropy_coef > 0
                )
        if self.critic is not None:
            values = critic_values(self.critic, q, qm, r, m)
        # a rollout-correction weight w >= 0 scales the advantage, which for the clipped losses is
        # the same as scaling the token's loss: w min(rA, clip(r)A) = min(r wA, clip(r) wA)
        adv = advantages[idx] if ro.weights is None else advantages[idx] * ro.weights[idx]
        batch = {"mask": m, "old_logprobs": ro.old_logprobs[idx], "ref_logprobs": ro.ref_logprobs[idx], "advantages": adv, "returns": returns[idx]}
        if ro.values is not None:
            batch["old_values"] = ro.values[idx]
        return ppo_loss(
            self.config, logprobs=logprobs, entropy=entropy, values=values if ro.values is not None else None,
            batch=batch, kl_coef=self.kl_ctl.value, penalty_beta=self.penalty_ctl.value if self.penalty_ctl else 0.0,
            train_policy=train_policy,
        )

    def update(self, ro: Rollout, advantages, returns) -> dict[str, float]:
        """ppo_epochs passes of shuffled minibatches, one optimizer step per minibatch (split
        into micro-batches). A step whose gradient norm is not finite is skipped, the weights
        and optimizer state untouched; `self._skipped` records why."""
        cfg, acc = self.config, self.accelerator
        n, mb, ga = len(ro), cfg.minibatch_size, cfg.gradient_accumulation_steps
        micro = mb // (ga * acc.num_processes)
        collected: dict[str, list[torch.Tensor]] = {}
        counts = {"policy/steps": 0.0, **({"train/overflow_steps": 0.0} if acc.scaler is not None else {})}
        params, shuffle = self._trained_parameters(), draws(cfg.seed, self.iteration, "shuffle")
        self._modes(training=True)
        stop = False
        for _ in range(cfg.ppo_epochs):
            if stop:
                break
            order = torch.randperm(n, generator=shuffle).to(self.device)
            for start in range(0, n, mb):
                minibatch = order[start : start + mb]  # every process holds the whole rollout
                mine = minibatch[acc.process_index * ga * micro : (acc.process_index + 1) * ga * micro]
                step_metrics: dict[str, list[torch.Tensor]] = {}
                for j in range(ga):
                    rows = mine[j * micro : (j + 1) * micro]
                    # this micro-batch's share of the minibatch's normaliser: the same gradient for any split
                    weight = micro_batch_weight(ro.mask[rows], ro.mask[minibatch], cfg.loss_agg, acc.num_processes)
                    with dist.no_sync(acc, (self.policy, self.critic), last=j == ga - 1):
                        loss, metrics = self.minibatch_loss(ro, rows, advantages, returns)
                        acc.backward(loss * weight)
                    for key, value in metrics.items():
                        step_metrics.setdefault(key, []).append(value)
                # taken after DDP's all-reduce: every process sees the same norm and decides alike
                grad_norms = self.clip_gradients(params)
                norm = torch.stack(list(grad_norms.values())).norm()  # finite iff every one is
                # Early stop on a target KL (Stable-Baselines3's `target_kl`): this minibatch's
                # approx KL, measured before its step, says how far the steps so far moved the
                # policy from the one that sampled the batch; past target_kl, no further step is
                # taken on it. The first minibatch is on-policy (KL 0), so one step is always
                # taken (unless `reproduce` makes the rollout off-policy, as Appendix A does).
                kl = torch.zeros_like(norm)
                if cfg.target_kl is not None and step_metrics.get("policy/approx_kl"):
                    kl = dist.mean_over_processes(acc, torch.stack([v.float() for v in step_metrics["policy/approx_kl"]]).mean())
                kl_value, norm_value = torch.stack([kl, norm]).tolist()  # the one read-back per minibatch
                if (cfg.target_kl is not None and kl_value > cfg.target_kl) or not math.isfinite(norm_value):
                    # Dropped without a step. Under fp16 the scaler has already unscaled these
                    # gradients and refuses to again until update(), which also lowers the scale.
                    if acc.scaler is not None:
                        acc.scaler.update()
                    self.optimizer.zero_grad(set_to_none=True)
                    if math.isfinite(norm_value):
                        stop = True  # past target_kl: no more steps on this batch
                        break
                    bad = [k for k, vs in step_metrics.items() if not all(bool(torch.isfinite(v).all()) for v in vs)]
                    if acc.scaler is not None and not bad:
                        counts["train/overflow_steps"] += 1  # fp16's scale was too large: how fp16 training starts
                    else:
                        self._skipped.append(("non-finite gradients", "policy/grad_norm", f"{norm_value}" + (f"; non-finite: {', '.join(bad)}" if bad else "")))
                    continue
                for key, values in [*step_metrics.items(), *((k, [v]) for k, v in grad_norms.items())]:
                    collected.setdefault(key, []).extend(values)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                counts["policy/steps"] += 1
        return {**mean_metrics(collected, lambda t: dist.mean_over_processes(acc, t)), **counts}

    def clip_gradients(self, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Clip the gradients to `max_grad_norm`; return their norms before clipping, as metrics:
        "policy/grad_norm" of all of `params` together (grad_clip_scope = "global"), or that of the
        policy's and "critic/grad_norm" of the critic's (or value head's), each clipped alone."""
        cfg, acc = self.config, self.accelerator
        limit = cfg.max_grad_norm or math.inf
        # build_optimizer names the groups (a checkpoint's optimizer state from before it did not: by order)
        groups = {group.get("name", ("policy", "critic")[i]): group["params"] for i, group in enumerate(self.optimizer.param_groups)}
        if cfg.grad_clip_scope == "global" or "critic" not in groups:
            return {"policy/grad_norm": torch.as_tensor(acc.clip_grad_norm_(params, limit)).detach().float().to(self.device)}
        acc.unscale_gradients()  # (fp16: once for the whole optimizer, before either norm)
        return {f"{name}/grad_norm": torch.nn.utils.clip_grad_norm_(groups[name], limit).detach().float().to(self.device) for name in ("policy", "critic")}

    # --- one iteration: rollout -> shape -> advantages -> update -> log ---------------------
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
        ro, sampling = self.collect()
        if self.device.type == "cuda":
            # give the rollout's cached blocks (logits, KV cache) back before the update, so the
            # allocator does not hold both phases' fragments at once (as TRL does)
            torch.cuda.empty_cache()
        # measured before the update, so a gold_fn that fails does so before the weights move
        gold = self.gold_mean(ro.prompts, ro.responses) if self.gold_fn is not None else None
        t1 = time.perf_counter()
        kl_coef = self.kl_ctl.value
        self._skipped = rollout_problems(ro, cfg.whiten_advantages, self.reward_name)
        norm_before = weight_norm(self._trained_parameters())
        metrics, rewards, advantages = {}, None, None
        if not self._skipped:
            with skip_value_checks():  # the rollout was checked once, just above
                rewards, advantages, returns = self.advantages(ro)
                metrics = self.update(ro, advantages, returns)
        t2 = time.perf_counter()
        with skip_value_checks():
            stats = rollout_metrics(
                scores=ro.scores, has_eos=ro.has_eos, old_logprobs=ro.old_logprobs, ref_logprobs=ro.ref_logprobs, entropy=ro.entropy,
                mask=ro.mask, rewards=rewards, advantages=advantages, kl_coef=kl_coef, kl_in=cfg.kl_in, kl_estimator=cfg.kl_estimator,
            )
        if self.old_logprobs_from == "forward":  # the trainer's log-probs beside the sampler's: how far apart they are
            with skip_value_checks():
                stats.update(gap_metrics(
                    ro.old_logprobs, ro.sampler_logprobs, ro.mask, ro.weights if ro.weights is not None else ro.mask.float(),
                    kind=cfg.rollout_correction, level=cfg.rollout_correction_level,
                ))
        extra = {"tokens": ro.mask.sum(), "norm_before": norm_before, "norm_after": weight_norm(self._trained_parameters())}
        stats = dict(zip([*stats, *extra], torch.stack([v.detach().float().to(self.device) for v in [*stats.values(), *extra.values()]]).tolist()))
        n_tokens, norms = stats.pop("tokens"), (stats.pop("norm_before"), stats.pop("norm_after"))
        if not self._skipped:
            if self.penalty_ctl is not None and "policy/approx_kl" in metrics:  # absent if no step was taken
                metrics["policy/penalty_beta"] = self.penalty_ctl.value
                self.penalty_ctl.update(metrics["policy/approx_kl"])
            self.kl_ctl.update(stats["objective/kl"], len(ro))
        self.iteration += 1
        metrics = {
            **metrics, "iteration": self.iteration, **stats, **sampling, "kl/coef": kl_coef, "train/skipped_updates": float(bool(self._skipped)),
            "time/rollout": t1 - t0, "time/update": t2 - t1, "perf/tokens_per_s": n_tokens / max(t2 - t0, 1e-9),
            "perf/peak_memory_mb": dist.max_peak_memory_mb(self.accelerator), "lr": self.scheduler.get_last_lr()[0],
        }
        if gold is not None:
            metrics["reward/gold_mean"] = gold
        broken = weights_problem(*norms)
        newest = ckpt.list_checkpoints(self.output_dir / "checkpoints") if broken or self._skipped else []
        self.bad_updates += bool(self._skipped)
        message, fatal = health_message(self.iteration, broken, self._skipped, self.bad_updates, cfg, newest[0] if newest else None)
        if fatal:
            raise NonFiniteError(message, metrics=metrics)  # the failed iteration's metrics are still logged
        newest_checkpoint = lambda: next(iter(ckpt.list_checkpoints(self.output_dir / "checkpoints")), None)
        for note in (message, self.collapse.observe(self.iteration, stats, cfg.learning_rate, newest_checkpoint)):
            if note:
                warnings.warn(note, RuntimeWarning, stacklevel=2)
        return metrics

    # --- evaluation and the loop --------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, n: int | None = None, seed: int | None = None) -> list[dict]:
        """Sample one response for each of the first `n` eval prompts and score it, with draws of
        its own (from `seed`, default config.seed): evaluating does not change training, and the
        same prompt gets the same draws at every evaluation."""
        prompts = self.eval_prompts[: n or self.config.eval_prompts]
        uniforms = torch.rand(len(prompts), self.sampling.max_new_tokens, generator=draws(self.config.seed if seed is None else seed, None, "eval"))
        self._modes(training=False)
        with self.accelerator.autocast():
            drawn = generate(self.lm, self.tokenizer, prompts, self.sampling, device=self.device, uniforms=uniforms)
        responses = self.tokenizer.batch_decode(drawn.response_ids, skip_special_tokens=True)
        scores = self.score(prompts, responses, drawn)
        samples = [{"iteration": self.iteration, "prompt": p, "response": r, "score": s} for p, r, s in zip(prompts, responses, scores.tolist())]
        if self.gold_fn is not None:
            for sample, gold in zip(samples, self.gold_scores(prompts, responses).tolist()):
                sample["gold"] = gold
        return samples

    def train(self, iterations: int | None = None) -> list[dict]:
        """Run `iterations` PPO iterations (default: the rest of `total_iterations`)."""
        from tqdm import tqdm

        cfg = self.config
        total = iterations if iterations is not None else cfg.total_iterations - self.iteration
        if not self.out.ready:
            logged = [m for m in self.history if m["iteration"] % cfg.log_interval == 0]  # the rows its checkpoint holds
            self.out.prepare(iteration=self.iteration, resumed=self.resumed_from is not None, config=cfg.to_dict(), run_id=self.run_id, trackers=bool(cfg.report_to), logged=logged)
        bar = tqdm(range(total), desc="ppo", disable=not cfg.progress_bar or not self.accelerator.is_main_process, dynamic_ncols=True)
        for _ in bar:
            try:
                metrics = self.step()
            except NonFiniteError as err:
                if getattr(err, "metrics", None) is not None:
                    self._log(err.metrics)
                raise
            if cfg.eval_interval and self.iteration % cfg.eval_interval == 0:
                samples = self.evaluate()
                metrics["eval/score_mean"] = sum(s["score"] for s in samples) / len(samples)
                if self.gold_fn is not None:
                    metrics["eval/gold_mean"] = sum(s["gold"] for s in samples) / len(samples)
                self.out.append("samples.jsonl", samples)
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
            self.out.log(metrics, self.iteration)

    # --- saving and resuming ------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        """Save the policy and tokenizer with `save_pretrained` (loadable as a hub model). A LoRA
        policy is saved merged (base + adapter), so the folder loads without peft."""
        if note := self.collapse.saving(self.iteration, f"the policy saved to {str(folder)!r}"):
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        return self.out.save_folder(folder, lambda tmp: save_policy(self.lm, self.tokenizer, tmp, lora=self.config.lora_r > 0))

    def save_checkpoint(self) -> Path:
        """Write a full checkpoint of the run to output_dir/checkpoints (see `ppo_lab.resume`)."""
        from .resume import save_trainer_checkpoint

        if note := self.collapse.saving(self.iteration, "the checkpoint written"):
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        return save_trainer_checkpoint(self)

    def resume(self, where: str | Path) -> Path:
        """Continue from a checkpoint folder, or "latest" in output_dir/checkpoints (see `ppo_lab.resume`)."""
        from .resume import load_trainer_checkpoint

        self.resumed_from = load_trainer_checkpoint(self, where)
        return self.resumed_from
