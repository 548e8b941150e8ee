"""The PPO trainer: rollout, reward shaping, advantages, clipped updates, repeat.

Chapter 7 (The PPO trainer end to end) reads this file from top to bottom. The loop composes
the pure functions of the earlier chapters and contains no math of its own:

    for each iteration:
        rollout     = sample responses, score tokens with policy / reference / critic  (sampling.py, rollout.py)
        scores      = reward(prompts, responses), adjusted                              (rewards.py, shaping.py)
        rewards     = shape_rewards(scores, old_logprobs, ref_logprobs, mask, kl_coef)  (chapter 5; objective.py)
        advantages  = estimator(rewards, mask, values, ...)                             (chapters 4, 10)
        for epoch in batch.epochs, for minibatch in shuffled minibatches:
            loss = ppo_loss(...): policy loss + critic.loss_coef * value loss - entropy bonus    (losses.py)
            backward, clip gradients, optimizer and scheduler step                      (optimizer_step.py)
        KL controller update, metrics, health checks                                    (chapter 5; metrics.py)

How it departs from the textbook algorithm, on purpose:
1. The score sits on the last real token; padding never enters GAE (see shaping.py, gae.py).
2. Log-probs are always taken at the sampling temperature, for the policy and the reference.
3. Dropout is off in every model, so the first update step is exactly on-policy (ratio = 1).
4. The KL penalty uses the rollout log-probs (fixed during the update) when it is in the
   reward; with `kl.placement: loss` it is recomputed with gradients at every step (GRPO style).
5. However a minibatch is split into micro-batches and processes, its gradient is that of the
   whole minibatch (optimizer_step.py, aggregation.py).
6. Every random draw of an iteration (the sampled tokens, the minibatch order) comes from a
   generator seeded by (seed, iteration), and each response's tokens depend only on its own
   draws. So a run split over N processes samples the same responses as one process, and a
   run resumed from a checkpoint continues exactly as the unbroken run would have.
7. Non-finite rewards, losses or gradients never reach the weights: the optimizer step is
   skipped with a warning that names the phase and the metric, and after `run.max_bad_updates`
   skipped updates the run stops, its last checkpoint untouched.

Each variant reaches the loop as an object the loop always calls: the sampler beside the
trainer (sampler.py, chapter 9), DAPO's collection of a batch (dynamic_sampling.py, chapter 10),
the advantages and the loss with the run's settings (objective.py), the other implementations'
choices (disagreements.py, Appendix A), the gold reward (rewards.py, chapter 8). So this file
is the loop alone, in five phases: rollout, reward, advantages, update, and the iteration's log.
"""

from __future__ import annotations

import contextlib
import time
import uuid
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from . import checkpoint as ckpt
from . import distributed as dist
from ._checks import NonFiniteError, check_eval_count, skip_value_checks
from .batch import Rollout
from .build import PromptStream, build_kl_controllers, build_optimizer, build_roles, build_task, draws, make_accelerator, seed_everything
from .config import PPOConfig
from .disagreements import Choices, first_step_metrics
from .dynamic_sampling import collector
from .metrics import RunHealth, eval_metrics, mean_metrics, rollout_metrics, rollout_problems, weight_norm
from .models import PolicyWithValueHead
from .objective import Objective
from .optimizer_step import OptimizerStep
from .reference_norm import reference_scores
from .resume import load_trainer_checkpoint, save_trainer_checkpoint
from .rewards import GoldReward, check_scores, reads_token_ids, score_responses
from .rollout import check_chunkable, critic_values, response_logprobs, score_tokens
from .run_output import RunOutput, save_policy
from .sampler import Sampler
from .sampling import generate
from .sharding import sharding_for
from .shaping import reference_normalization


class PPOTrainer:
    """PPO for a causal LM. Everything not passed in is built from `config`.

    Args:
        config: the `PPOConfig`.
        policy, tokenizer: an already loaded `AutoModelForCausalLM` and its tokenizer (optional).
        reward_fn: a callable (prompts, responses) -> scores, which may also take `ended`
            (see `ppo_lab.rewards`) (optional; default from config).
        train_prompts, eval_prompts: lists of prompt strings (optional; default: the task's).
        gold_fn: a second reward (prompts, responses) -> scores, measured and never trained on:
            `reward/gold_mean`, and a "gold" score in evaluation samples (`rewards.GoldReward`). (optional)
    """

    def __init__(self, config: PPOConfig, *, policy=None, tokenizer=None, reward_fn=None, train_prompts=None, eval_prompts=None, gold_fn=None):
        self.config = cfg = config
        seed_everything(cfg.run.seed)
        self.accelerator = make_accelerator(cfg)
        dist.check_distributed_backend(self.accelerator.distributed_type)
        cfg.check_divisibility(self.accelerator.num_processes)
        self.device = self.accelerator.device
        self.output_dir = Path(cfg.run.output_dir)
        self.out = RunOutput(cfg.run.output_dir, self.accelerator, cfg.run.overwrite)
        if not cfg.run.resume_from:
            self.out.check()  # before minutes of loading, not after
        else:
            ckpt.resolve_resume_from(cfg.run.resume_from, cfg.run.output_dir)  # a mistyped checkpoint, likewise

        task = build_task(cfg, self.device, train_prompts, eval_prompts, reward_fn)
        self.task = task.builtin  # the built-in task (ppo_lab.tasks), None when prompts and reward were given
        self.sharding = sharding_for(cfg.memory, self.device)  # DDP or every role sharded; frozen weights in bf16 or not (chapter 9); a reward_fn given is left as it is
        self.train_prompts, self.eval_prompts, self.reward_fn, self.reward_name = task.train_prompts, task.eval_prompts, task.reward_fn if reward_fn is not None else self.sharding.shard_reward(task.reward_fn), task.reward_name
        roles = build_roles(cfg, task, self.device, policy, tokenizer)
        self.tokenizer, self.reference, self.sampling = roles.tokenizer, self.sharding.shard(roles.reference), roles.sampling
        policy, critic = self.sharding.shard(roles.policy), self.sharding.shard(roles.critic)  # (before the optimizer sees them)
        optimizer, self.scheduler = build_optimizer(cfg, policy, critic)
        models, self.optimizer = self.sharding.prepare(self.accelerator, [m for m in (policy, critic) if m is not None], optimizer)
        self.policy, self.critic = models[0], (models[1] if critic is not None else None)
        self.stepper = OptimizerStep(
            self.accelerator, self.optimizer, self.scheduler, models, minibatch_size=cfg.batch.minibatch, accumulation=cfg.batch.accumulation_steps,
            loss_agg=cfg.loss.aggregation, max_grad_norm=cfg.optim.max_grad_norm, clip_scope=cfg.optim.clip_scope, target_kl=cfg.optim.early_stop_kl,
        )
        # ppo_lab's choices where implementations disagree, or the others' for Appendix A (`run.reproduce`)
        self.choices = Choices.parse(cfg.run.reproduce)
        self.choices.prepare(models)
        self.score_temperature = self.choices.score_temperature(cfg.sampling.temperature)  # the temperature of every log-prob forward
        if cfg.memory.logprob_chunk:  # refuse a model whose logits are not lm_head(hidden), before any training
            with self.accelerator.autocast():  # (the head then runs in the forward's precision)
                check_chunkable(self.bare(self.policy), self.tokenizer(self.train_prompts[:1], return_tensors="pt", add_special_tokens=False)["input_ids"].to(self.device))
        self.kl_ctl, self.penalty_ctl = build_kl_controllers(cfg)
        self.objective = Objective(cfg, self.choices)  # the advantages and the loss with this run's settings
        self.sampler = Sampler.from_config(cfg, self.lm)  # who samples, and where pi_old comes from (chapter 9)
        groups = cfg.batch.rollout // cfg.sampling.responses_per_prompt
        self.collector = collector(cfg.sampling.dynamic, cfg.sampling.responses_per_prompt, groups, cfg.sampling.dynamic_max_rounds)
        # a reward model with the policy's tokenizer reads the sampled ids, EOS included (rewards.py)
        self.reward_by_ids = reads_token_ids(self.reward_fn, self.tokenizer)
        self.gold = GoldReward(gold_fn)
        self.score_gain, self.score_bias = 1.0, 0.0  # reward.reference_norm's fixed map (set below)

        self.iteration, self.health, self._skipped = 0, RunHealth(cfg.run.max_bad_updates, cfg.optim.lr), []  # (why this iteration's steps were skipped)
        self.history: list[dict] = []
        self.prompt_stream = PromptStream(self.train_prompts, groups, cfg.run.seed)
        self.run_id = uuid.uuid4().hex  # a resumed run takes its checkpoint's
        self.resumed_from: Path | None = None
        if cfg.run.resume_from:
            self.resume(cfg.run.resume_from)  # (restores the score gain and bias too)
        elif cfg.reward.reference_norm != "none":
            self.score_gain, self.score_bias = reference_normalization(self.reference_scores(cfg.reward.reference_samples), cfg.reward.reference_norm)  # fixed from here on

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

    def set_training(self, training: bool) -> None:
        """Train mode for the update, eval mode for sampling and scoring (dropout is off either way; gradient checkpointing acts in train mode only)."""
        for model in (m for m in (self.policy, self.critic) if m is not None):
            model.train(training)

    def trained_parameters(self) -> list[torch.Tensor]:
        """Every parameter the optimizer updates (policy and critic)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def next_prompts(self) -> list[str]:
        """The prompts of the next rollout (see `build.PromptStream`)."""
        return self.prompt_stream.next()

    # --- 1. rollout: sample, score every token with every model -------------------------------
    @torch.no_grad()
    def rollout(self, prompts: list[str], attempt: int = 0) -> Rollout:
        """Sample `sampling.responses_per_prompt` responses per prompt, score their tokens with the policy,
        the reference and the critic, and the responses with the reward. Each process does its
        share; the returned rollout is the whole batch. Non-finite scores are left for `step`.
        `attempt` > 0 draws other tokens for the extra rollouts of dynamic sampling."""
        k = self.config.sampling.responses_per_prompt
        repeated = [p for p in prompts for _ in range(k)]
        lo, hi = dist.shard(self.accelerator, len(repeated))
        mine = repeated[lo:hi]
        uniforms = torch.rand(len(repeated), self.sampling.max_new_tokens, generator=draws(self.config.run.seed, self.iteration, "sample", attempt))[lo:hi]
        from_sampling, value_head = self.sampler.from_sampling, self.sampler.value_head(self.bare(self.policy))
        self.set_training(False)
        # One autocast region for every forward (the sampling loop calls the bare LM, outside
        # the autocast accelerate wraps the prepared model in): in bf16 the policy and the
        # reference then agree exactly before the first update, and the bf16 copies of the
        # weights are made once per rollout, not once per token.
        with self.accelerator.autocast():
            with self.sampler.autocast(self.device.type), self.sharding.gathered(self.policy):
                # the sampler's log-probs are kept beside the trainer's (computed from the logits each token was drawn from)
                drawn = generate(
                    self.sampler.model(self.lm, self.iteration), self.tokenizer, mine, self.sampling, device=self.device, uniforms=uniforms,
                    with_logprobs=True, with_entropy=from_sampling, value_head=value_head,  # (the entropy of a forward otherwise)
                )
            old_logprobs, ref_logprobs, values, entropy = score_tokens(
                self.policy, self.reference, self.critic, drawn.query_ids, drawn.query_mask, drawn.response_ids, drawn.mask, self.score_temperature,
                old_logprobs=drawn.sampler_logprobs if from_sampling else None, entropy=drawn.entropy if from_sampling else None,
                values=drawn.values, batch_size=self.config.batch.forward, chunk_size=self.config.memory.logprob_chunk,
            )
        responses = self.tokenizer.batch_decode(drawn.response_ids, skip_special_tokens=True)
        parts = dict(
            responses=responses, query_ids=drawn.query_ids, query_mask=drawn.query_mask, response_ids=drawn.response_ids, mask=drawn.mask,
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, values=values, entropy=entropy, ended=drawn.ended,
            scores=self.score(mine, responses, drawn).to(self.device), sampler_logprobs=drawn.sampler_logprobs,
        )
        parts = dist.gather_rollout(self.accelerator, parts, self.tokenizer.pad_token_id)
        ro = Rollout(prompts=repeated, group_ids=torch.arange(len(prompts), device=self.device).repeat_interleave(k), **parts)
        ro.weights = self.sampler.weights(ro.old_logprobs, ro.sampler_logprobs, ro.mask)  # None unless a correction is on
        return ro

    def collect(self) -> tuple[Rollout, dict[str, float]]:
        """This iteration's batch and its dynamic_sampling/* metrics: the rollout of the next prompts, or
        DAPO's dynamic sampling of several (`dynamic_sampling`, chapter 10)."""
        return self.collector.collect(self.rollout, self.next_prompts, self.tokenizer.pad_token_id)

    # --- 2. reward -------------------------------------------------------------------------------
    def score(self, prompts: list[str], responses: list[str], drawn) -> torch.Tensor:
        """(B,) raw scores of `drawn` (a `sampling.Sample`) from the reward (`rewards.score_responses`), checked; nan and inf are left for `step`."""
        with self.accelerator.autocast():  # a reward model runs in the forwards' precision, as the other roles do (it ran 112 fp32 GEMMs per update in bf16)
            raw = score_responses(self.reward_fn, prompts, responses, drawn, self.reward_by_ids)
        return check_scores(raw, len(prompts), f"reward {self.reward_name}", finite=False)

    def reference_scores(self, n: int) -> torch.Tensor:
        """(n,) scores of n reference-policy responses (see `ppo_lab.reference_norm`)."""
        return reference_scores(self, n)

    # --- 3. the advantages -----------------------------------------------------------------------
    def advantages(self, ro: Rollout):
        """(rewards, advantages, returns), each (B, T), with this iteration's KL coefficient and
        the run's fixed score map (see `Objective.advantages`)."""
        return self.objective.advantages(ro, self.kl_ctl.value, self.score_gain, self.score_bias)

    # --- 4. the update: epochs of shuffled minibatches ----------------------------------------
    def update(self, ro: Rollout, advantages, returns) -> dict[str, float]:
        """batch.epochs passes of shuffled minibatches, one optimizer step per minibatch
        (`OptimizerStep.step`: clip, skip a non-finite gradient, stop past `optim.early_stop_kl`);
        `self._skipped` records why a step was skipped."""
        cfg = self.config
        collected: dict[str, list[torch.Tensor]] = {}
        counts = self.stepper.counts()
        shuffle = draws(cfg.run.seed, self.iteration, "shuffle")
        loss = lambda rows: self.minibatch_loss(ro, rows, advantages, returns)  # noqa: E731
        self.set_training(True)
        for _ in range(cfg.batch.epochs):
            order = torch.randperm(len(ro), generator=shuffle).to(self.device)
            for start in range(0, len(ro), cfg.batch.minibatch):
                if not self.stepper.step(ro.mask, order[start : start + cfg.batch.minibatch], loss, collected, counts, self._skipped):
                    return {**mean_metrics(collected, self.mean_over_processes), **counts}  # past optim.early_stop_kl
        return {**mean_metrics(collected, self.mean_over_processes), **counts}

    def minibatch_loss(self, ro: Rollout, idx: torch.Tensor, advantages, returns):
        """The loss of the rollout's rows `idx` under the current weights, and its metrics."""
        q, qm, r, m = ro.query_ids[idx], ro.query_mask[idx], ro.response_ids[idx], ro.mask[idx]
        train_policy = self.iteration >= self.config.critic.warmup_iterations
        values, logprobs, entropy = None, None, None
        if train_policy or self.critic is None:  # (a value warm-up with a separate critic needs no policy forward)
            chunk = self.config.memory.logprob_chunk
            # the chunked LM head runs outside the model's forward, so outside the autocast accelerate gives it
            with self.accelerator.autocast() if chunk else contextlib.nullcontext():
                logprobs, entropy, values = response_logprobs(
                    self.policy, q, qm, r, m, self.score_temperature, chunk_size=chunk, with_entropy=train_policy and self.config.loss.entropy_coef > 0
                )
        if self.critic is not None:
            values = critic_values(self.critic, q, qm, r, m)
        # a rollout-correction weight w >= 0 scales the advantage, which for the clipped losses is
        # the same as scaling the token's loss: w min(rA, clip(r)A) = min(r wA, clip(r) wA)
        adv = advantages[idx] if ro.weights is None else advantages[idx] * ro.weights[idx]
        batch = {"mask": m, "old_logprobs": ro.old_logprobs[idx], "ref_logprobs": ro.ref_logprobs[idx], "advantages": adv, "returns": returns[idx]}
        if ro.values is not None:
            batch["old_values"] = ro.values[idx]
        return self.objective.loss(
            logprobs=logprobs, entropy=entropy, values=values if ro.values is not None else None, batch=batch,
            kl_coef=self.kl_ctl.value, penalty_beta=self.penalty_ctl.value if self.penalty_ctl else 0.0, train_policy=train_policy,
        )

    def mean_over_processes(self, value: torch.Tensor) -> torch.Tensor:
        return dist.mean_over_processes(self.accelerator, value.to(self.device))  # (itself on one process)

    # --- 5. one iteration: phases 1-4, then its log ------------------------------------------
    def iterate(self) -> dict[str, float]:
        """One PPO iteration; returns its metrics (fixed names, the book's "Metrics" page).

        Non-finite rewards, log-probs or values skip the whole update; non-finite gradients skip
        that optimizer step. Either way a warning names the phase and the metric, and once
        `run.max_bad_updates` updates have been skipped a `NonFiniteError` stops the run.
        """
        cfg = self.config
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        ro, sampling = self.collect()  # 1-2: sampled, scored by every model and by the reward
        if self.device.type == "cuda":
            # give the rollout's cached blocks (logits, KV cache) back before the update, so the
            # allocator does not hold both phases' fragments at once (as TRL does)
            torch.cuda.empty_cache()
        # measured before the update, so a gold reward that fails does so before the weights move
        gold = self.gold.rollout_metrics(ro.prompts, ro.responses, self.mean_over_processes)
        t1 = time.perf_counter()
        kl_coef = self.kl_ctl.value
        self._skipped = rollout_problems(ro, cfg.advantage.whiten, self.reward_name)
        norm_before = weight_norm(self.trained_parameters())
        metrics, rewards, advantages = {}, None, None
        if not self._skipped:
            with skip_value_checks():  # the rollout was checked once, just above
                rewards, advantages, returns = self.advantages(ro)  # 3
                metrics = self.update(ro, advantages, returns)  # 4
        t2 = time.perf_counter()
        # 5: the log. Every rollout metric comes back from the device in one read-back.
        with skip_value_checks():
            stats = rollout_metrics(
                scores=ro.scores, ended=ro.ended, old_logprobs=ro.old_logprobs, ref_logprobs=ro.ref_logprobs, entropy=ro.entropy,
                mask=ro.mask, rewards=rewards, advantages=advantages, kl_coef=kl_coef, kl_in=cfg.kl.placement, kl_estimator=cfg.kl.estimator,
            )
            stats.update(self.sampler.metrics(ro.old_logprobs, ro.sampler_logprobs, ro.mask, ro.weights))  # the sampler/trainer gap
        extra = {"tokens": ro.mask.sum(), "norm_before": norm_before, "norm_after": weight_norm(self.trained_parameters())}
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
            "perf/peak_memory_mb": dist.max_peak_memory_mb(self.accelerator), "lr": self.scheduler.get_last_lr()[0], **gold,
        }
        checkpoints = lambda: ckpt.list_checkpoints(self.output_dir / "checkpoints")  # noqa: E731
        for note in self.health.after(self.iteration, self._skipped, *norms, stats, metrics, checkpoints):
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        return metrics

    def first_step_metrics(self) -> dict[str, float]:
        """The loss metrics the first step of an update would see (`disagreements.first_step_metrics`)."""
        return first_step_metrics(self)

    # --- evaluation and the loop --------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, n: int | None = None, seed: int | None = None) -> list[dict]:
        """Score one response to each of the first `n` eval prompts (None: `run.eval_count`, or all when fewer;
        more is refused) with draws of its own (`seed`, default run.seed): the same at every evaluation."""
        check_eval_count(n, len(self.eval_prompts))
        prompts = self.eval_prompts[: n or self.config.run.eval_count]
        uniforms = torch.rand(len(prompts), self.sampling.max_new_tokens, generator=draws(self.config.run.seed if seed is None else seed, None, "eval"))
        self.set_training(False)
        with self.accelerator.autocast(), self.sharding.gathered(self.policy):
            drawn = generate(self.lm, self.tokenizer, prompts, self.sampling, device=self.device, uniforms=uniforms)
        responses = self.tokenizer.batch_decode(drawn.response_ids, skip_special_tokens=True)
        scores = self.score(prompts, responses, drawn)
        samples = [{"iteration": self.iteration, "prompt": p, "response": r, "score": s} for p, r, s in zip(prompts, responses, scores.tolist())]
        return self.gold.annotate(samples, prompts, responses)

    def train(self, iterations: int | None = None) -> list[dict]:
        """Run `iterations` PPO iterations (default: the rest of `run.iterations`)."""
        cfg = self.config
        total = iterations if iterations is not None else cfg.run.iterations - self.iteration
        if not self.out.ready:
            logged = [m for m in self.history if m["iteration"] % cfg.run.log_interval == 0]  # the rows its checkpoint holds
            self.out.prepare(iteration=self.iteration, resumed=self.resumed_from is not None, config=cfg.to_dict(), run_id=self.run_id, trackers=bool(cfg.run.report_to), logged=logged)
        bar = tqdm(range(total), desc="ppo", disable=not cfg.run.progress_bar or not self.accelerator.is_main_process, dynamic_ncols=True)
        for _ in bar:
            try:
                metrics = self.iterate()
            except NonFiniteError as err:
                if getattr(err, "metrics", None) is not None:
                    self._log(err.metrics)
                raise
            if cfg.run.eval_interval and self.iteration % cfg.run.eval_interval == 0:
                samples = self.evaluate()
                metrics.update(eval_metrics(samples))
                self.out.append("samples.jsonl", samples)
            self._log(metrics)
            bar.set_postfix(score=f"{metrics['reward/score_mean']:.3f}", kl=f"{metrics['objective/kl']:.3f}")
            if cfg.run.save_interval and self.iteration % cfg.run.save_interval == 0 and not metrics["train/skipped_updates"]:
                self.save_checkpoint()
        if self.iteration >= cfg.run.iterations:
            self.save(self.output_dir / "policy")
        return self.history

    def _log(self, metrics: dict) -> None:
        self.history.append(metrics)
        if self.iteration % self.config.run.log_interval == 0:
            self.out.log(metrics, self.iteration)

    # --- saving and resuming ------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        """Save the policy and tokenizer with `save_pretrained` (a hub model's folder; a LoRA policy merged, loadable without peft)."""
        if note := self.health.collapse.saving(self.iteration, f"the policy saved to {str(folder)!r}"):
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        state = self.sharding.full_state_dict(self.policy, self.lm)  # (every process gathers; None unsharded)
        return self.out.save_folder(folder, lambda tmp: save_policy(self.lm, self.tokenizer, tmp, lora=self.config.lora.r > 0, state_dict=state))

    def save_checkpoint(self) -> Path:
        """Write a full checkpoint of the run to output_dir/checkpoints (see `ppo_lab.resume`)."""
        if note := self.health.collapse.saving(self.iteration, "the checkpoint written"):
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        return save_trainer_checkpoint(self)

    def resume(self, where: str | Path) -> Path:
        """Continue from a checkpoint folder, or "latest" in output_dir/checkpoints (see `ppo_lab.resume`)."""
        self.resumed_from = load_trainer_checkpoint(self, where)
        return self.resumed_from
