"""`PPOConfig`: the one typed configuration of the trainer, its YAML files and its command line.

Chapter 7 (The PPO trainer end to end) walks through it. Each field carries its help text once,
in `field(metadata={"help": ...})`; the command line (`ppo-lab train --help`) and the error
messages are generated from it. The config is validated when it is constructed, so a bad value
fails before any model is loaded, with a message that names the field, the value and what is
allowed.

Batch sizes, in one place. One PPO iteration samples `rollout_batch_size` responses (that is,
`rollout_batch_size / responses_per_prompt` prompts), then makes `ppo_epochs` passes over them
in shuffled minibatches of `minibatch_size` responses; each minibatch is one optimizer step,
split into micro-batches for memory. The rollout and minibatch sizes are global: under
`accelerate launch` with N processes, each process samples `rollout_batch_size / N` responses,
the rollout is gathered so that whitening, the KL controller and every metric see the whole
batch, and each minibatch is cut into `gradient_accumulation_steps x N` micro-batches of
`minibatch_size / (gradient_accumulation_steps x N)` responses, `gradient_accumulation_steps`
on each process. A run on N processes therefore computes the same update as a run on one
process with `gradient_accumulation_steps x N` (tests/test_distributed.py checks it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .aggregation import AGGREGATION_MODES
from .kl import KL_ESTIMATORS
from .rollout_correction import CORRECTIONS, LEVELS


# Old names of fields, pointed to the new one (difflib would send `kind`, the KL estimator's name in
# `kl_penalty(..., kind)`, to `kl_in`).
RENAMED = {"kind": "kl_estimator"}


def _f(default, help: str, choices=None, *, low=None, high=None, low_open=False, high_open=False, resume="fixed"):
    """A field with its help text, and the one statement of what it accepts.

    `low` / `high` bound a number (open or closed ends; an int field is checked as an integer
    >= low); an optional field (type `X | None`) accepts None too. `resume`: "free" when the
    field may change between a run and its resumption without changing what the run computes
    (logging, checkpointing, the length of the run); "fixed" fields are compared on resume.
    """
    meta = {"help": help, "resume": resume}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if low is not None:
        meta["range"] = (low, high, low_open, high_open)
    return field(default=default, metadata=meta)


def free_on_resume() -> set[str]:
    """The fields a resumed run may change (the rest must match the checkpoint's config)."""
    return {f.name for f in dataclasses.fields(PPOConfig) if f.metadata["resume"] == "free"}


@dataclass
class PPOConfig:
    # --- models --------------------------------------------------------------------------
    policy_model: str = _f("builtin:tiny", "Policy to train: a hub name (org/model, or org/model@revision), a local folder, or builtin:tiny (the offline default).")
    tokenizer: str | None = _f(None, "Tokenizer to use; defaults to the policy's.")
    critic: str = _f("separate", "Critic design: a separate model with a scalar head, a value head on the policy's backbone, or none (for critic-free estimators such as grpo and rloo).", ("separate", "shared", "none"))
    value_pooling: str = _f("token", "What the separate critic's head reads at position t: the hidden state at t, or the mean of the hidden states of the real tokens up to t.", ("token", "mean"))
    critic_model: str | None = _f(None, "Initialise the separate critic from this model (hub name or folder, e.g. the reward model); default: the policy.")
    reward: str | None = _f(None, "Reward: a sequence-classification model (hub name or folder), or module:function for a Python callable; default: the task's gold reward.")
    reward_label_index: int = _f(-1, "For a classification reward model with several labels, the logit used as the score.")
    trust_remote_code: bool = _f(False, "Allow model code from the hub to run (off unless you trust the source).")
    # --- task ----------------------------------------------------------------------------
    task: str = _f("sentiment", "Built-in task providing prompts and the gold reward.", ("sentiment", "arithmetic", "arithmetic-small"))
    prompts_file: str | None = _f(None, "Training prompts from a file instead of the task's: .jsonl or .json (JSON lines, the prompt under prompt_field), anything else one prompt per line.")
    eval_prompts_file: str | None = _f(None, "Eval prompts from a file (same formats); default: the task's eval prompts, or the training prompts when prompts_file is given.")
    prompt_field: str = _f("prompt", "The key of the prompt in each line of a .jsonl or .json prompts file (the TL;DR data of N+ calls it query).")
    # --- generation ----------------------------------------------------------------------
    max_new_tokens: int = _f(12, "Most tokens generated per response.", low=1)
    temperature: float = _f(1.0, "Sampling temperature; the same value is used in every log-prob forward.", low=0.0, low_open=True)
    top_k: int = _f(0, "Sample from the k most likely tokens only (0 = off). Makes the PPO ratio approximate.", low=0)
    top_p: float = _f(1.0, "Nucleus sampling threshold (1.0 = off). Makes the PPO ratio approximate.", low=0.0, high=1.0, low_open=True)
    stop_token: str | None = _f(None, "An extra token that ends a response, besides EOS.")
    stop_after: int = _f(0, "A stop token (EOS or stop_token) ends a response only at response position >= stop_after (0-based); an earlier one is an ordinary token. Sampling itself is unchanged, so the ratio stays exact (OpenAI 2019: stop_token '.', stop_after 16).", low=0)
    old_logprobs: str = _f("auto", "Where the rollout's log-probs pi_old (and a shared value head's values) come from: the logits the tokens were sampled from (no extra forward; with a sampler that differs from the trainer, verl's bypass form), a separate forward pass of the trainer (the decoupled form), or auto: sampling in fp32 when the sampler is the trainer, else forward.", ("auto", "sampling", "forward"))
    ignore_eos: bool = _f(False, "Never stop a response: sample exactly max_new_tokens tokens, all of them real (for benchmarks).")
    # --- batches -------------------------------------------------------------------------
    rollout_batch_size: int = _f(64, "Responses sampled per PPO iteration (global: each of N processes samples rollout_batch_size / N).", low=1)
    responses_per_prompt: int = _f(1, "Responses sampled for each prompt (>1 for rloo/grpo).", low=1)
    minibatch_size: int = _f(16, "Responses per optimizer step (global); must divide rollout_batch_size.", low=1)
    forward_batch_size: int | None = _f(None, "Responses per scoring forward in the rollout (policy, reference, critic), on each process; None = its whole share at once. Lower it on a GPU to bound the memory of the (responses x length x vocabulary) logits.", low=1)
    gradient_accumulation_steps: int = _f(1, "Micro-batches per minibatch on each process; a micro-batch holds minibatch_size / (gradient_accumulation_steps x processes) responses.", low=1)
    ppo_epochs: int = _f(4, "Passes over each rollout batch.", low=1)
    total_iterations: int = _f(60, "PPO iterations (rollout + update) to run.", low=1, resume="free")
    # --- optimisation --------------------------------------------------------------------
    learning_rate: float = _f(3e-4, "AdamW learning rate (policy and critic); the default suits the tiny offline model, hub models want 1e-6 to 1e-5.", low=0.0, low_open=True)
    lr_schedule: str = _f("constant", "Learning-rate schedule after warmup.", ("constant", "linear", "cosine"))
    warmup_steps: int = _f(0, "Optimizer steps of linear warmup.", low=0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", low=0.0)
    adam_eps: float = _f(1e-8, "AdamW epsilon (PyTorch's default 1e-8; the published RLHF recipes use 1e-5).", low=0.0, low_open=True)
    critic_learning_rate: float | None = _f(None, "The critic's own learning rate (separate or shared critic's value head); None = learning_rate.", low=0.0, low_open=True)
    value_warmup_iterations: int = _f(0, "Iterations at the start of the run that train only the critic (the policy is not updated; VAPO's value pretraining).", low=0)
    max_grad_norm: float | None = _f(1.0, "Clip the gradient norm to this value (None = no clipping); one norm, or one per model (grad_clip_scope).", low=0.0, low_open=True)
    grad_clip_scope: str = _f("global", "Which gradients one norm covers: global, policy and critic together (CleanRL); per-model, the policy's and the critic's (or value head's) clipped each on its own (verl, OpenRLHF), so a large critic gradient does not shrink the policy's step.", ("global", "per-model"))
    # --- PPO losses ----------------------------------------------------------------------
    policy_loss: str = _f("clip", "Policy loss from the registry (ppo_lab.losses): clip, the clipped surrogate; kl_penalty, the adaptive KL penalty to the old policy (PPO-penalty); gspo, clipping each response's geometric-mean ratio; cispo, a clipped stop-gradient importance weight on REINFORCE; or one registered by you.")
    penalty_beta: float = _f(1.0, "Initial beta of PPO-penalty (policy_loss = kl_penalty).", low=0.0)
    penalty_kl_target: float = _f(0.01, "Target KL(old || new) per token of PPO-penalty; beta doubles above 1.5x, halves below 1/1.5x.", low=0.0, low_open=True)
    clip_eps: float = _f(0.2, "Policy ratio clip range epsilon.", low=0.0, low_open=True)
    clip_eps_high: float | None = _f(None, "Upper ratio clip range (None = clip_eps).", low=0.0, low_open=True)
    target_kl: float | None = _f(0.1, "Early stop: end an iteration's update before a minibatch whose policy/approx_kl (KL(old || new) per token, measured before its step) exceeds this (None = off).", low=0.0, low_open=True)
    dual_clip: float | None = _f(None, "Dual-clip constant c > 1 for negative advantages (None = off).", low=1.0, low_open=True)
    value_clip: float | None = _f(0.2, "Value clip range around the rollout values (None = off).", low=0.0)
    vf_coef: float = _f(0.5, "Weight of the value loss.", low=0.0)
    entropy_coef: float = _f(0.0, "Weight of the entropy bonus.", low=0.0)
    loss_agg: str = _f("token-mean", "How per-token losses are aggregated.", AGGREGATION_MODES)
    # --- advantages ----------------------------------------------------------------------
    advantage_estimator: str = _f("gae", "Advantage estimator from the registry: gae, reinforce, rloo, grpo, dr_grpo, reinforce_pp, reinforce_pp_baseline, or one registered by you.")
    gamma: float = _f(1.0, "Discount factor.", low=0.0, high=1.0)
    lam: float = _f(0.95, "GAE lambda, for the policy's advantages.", low=0.0, high=1.0)
    critic_lam: float | None = _f(None, "GAE lambda for the critic's return targets (VAPO's decoupled lambda, e.g. 1.0); None = lam.", low=0.0, high=1.0)
    whiten_advantages: bool = _f(True, "Normalise advantages to mean 0, std 1 over the real tokens of the batch.")
    whiten_rewards: bool = _f(False, "Scale the per-token shaped rewards to std 1 over the real tokens of the batch, keeping their mean (OpenAI 2019's whiten(rewards, shift_mean=False)).")
    # --- reward shaping and KL -----------------------------------------------------------
    kl_coef: float = _f(0.2, "Initial KL coefficient beta (per-token penalty weight).", low=0.0)
    kl_estimator: str = _f("k1", "Per-token KL estimator.", KL_ESTIMATORS)
    kl_in: str = _f("reward", "Put the KL penalty in the per-token reward, or add it to the loss. In the loss, the estimator's gradient is what counts: k1 has expected gradient 0, k2 that of KL(pi || pi_ref), k3 that of KL(pi_ref || pi) (Tang and Munos 2025; chapter 10).", ("reward", "loss"))
    kl_control: str = _f("fixed", "Keep beta fixed, or adapt it toward kl_target.", ("fixed", "adaptive"))
    kl_target: float = _f(6.0, "Target KL per response (adaptive control).", low=0.0, low_open=True)
    kl_horizon: float = _f(10000.0, "Horizon of the adaptive controller, in responses.", low=0.0, low_open=True)
    score_clip: float | None = _f(None, "Clip scores to [-score_clip, score_clip] (None = off).", low=0.0, low_open=True)
    score_norm: bool = _f(False, "Normalise scores to mean 0, std 1 over each rollout batch.")
    missing_eos_penalty: float | None = _f(None, "Subtract this from the score of a response that ran out of tokens: no stop token (EOS or stop_token) at a position >= stop_after (None = off).", low=0.0)
    missing_eos_score: float | None = _f(None, "Replace the score of a response that ran out of tokens (no stop token at a position >= stop_after) by this value (N and N+: -1; None = off).")
    reference_score_norm: str = _f("none", "Fix a gain and bias once, before training, from the scores of the reference policy's responses: mean-std gives them mean 0 and std 1 (OpenAI 2019), mean gives them mean 0 (N+ centres its SFT references); none = off.", ("none", "mean-std", "mean"))
    reference_score_samples: int = _f(256, "Responses sampled from the reference policy, to prompts drawn at random from the training prompts, to fit reference_score_norm.", low=2)
    # --- critic-free recipes: which samples and lengths count (chapter 10) ------------------
    dynamic_sampling: bool = _f(False, "DAPO's dynamic sampling: drop the groups whose responses all got the same raw score from the reward (their group advantages are then 0, unless the KL or the overlong penalty separates them) and sample more prompts until rollout_batch_size responses of informative groups are collected; needs responses_per_prompt >= 2.")
    dynamic_sampling_max_rounds: int = _f(4, "Most rollouts drawn per iteration by dynamic_sampling; a batch still short after them is filled with dropped groups (verl stops the run instead).", low=1)
    overlong_buffer: int = _f(0, "DAPO's soft overlong punishment: a response in the last overlong_buffer tokens of max_new_tokens loses score linearly, up to overlong_penalty_factor at the budget (0 = off).", low=0)
    overlong_penalty_factor: float = _f(1.0, "The score lost by a response of exactly max_new_tokens tokens, with overlong_buffer.", low=0.0)
    overlong_filter: bool = _f(False, "DAPO's overlong filtering: a response that ran out of tokens (no stop token) gets advantage 0, so it adds no policy gradient (its tokens still count in the loss's normaliser).")
    # --- the sampler and the trainer (chapter 9) ------------------------------------------
    rollout_correction: str = _f("none", "Importance weights for the gap between the sampler's log-probs and the trainer's (decoupled form: needs old_logprobs forward, which auto picks): tis truncates rho = pi_old / pi_sampler at rollout_correction_high; mis (IcePop) keeps rho inside [rollout_correction_low, rollout_correction_high] and zeroes it outside.", CORRECTIONS)
    rollout_correction_level: str = _f("token", "The ratio the correction acts on: each token's, or each response's product over its tokens (the same weight for all its tokens).", LEVELS)
    rollout_correction_low: float = _f(0.0, "Lower bound of mis (IcePop uses 0.5).", low=0.0)
    rollout_correction_high: float = _f(2.0, "Upper bound of tis and mis (the TIS recipes use 2; IcePop 5).", low=1.0)
    sampler_noise: float = _f(0.0, "Experiments only: sample from a copy of the policy whose every weight is multiplied by (1 + sampler_noise x N(0, 1)), drawn afresh each iteration; a stand-in for an inference engine whose numerics differ from the trainer's.", low=0.0)
    sampler_precision: str = _f("same", "Experiments only: bf16 samples under bfloat16 autocast while the trainer's forwards keep `precision` (the sampler/trainer gap of an fp32 trainer).", ("same", "bf16"))
    # --- experiments only: other implementations' choices (Appendix A) --------------------
    reproduce: str | None = _f(None, "Reproduce other implementations' choices where they disagree with ppo_lab's (Appendix A; off by default, never for real training): comma-separated from score-past-last, gae-over-padding, whiten-with-padding, temperature-1-in-scoring, dropout-on (see ppo_lab.disagreements).")
    # --- run -----------------------------------------------------------------------------
    seed: int = _f(0, "Random seed (0 to 2**32 - 1, the range NumPy accepts).", low=0, high=2**32 - 1)
    precision: str = _f("fp32", "Mixed precision (bf16/fp16 on GPU; master weights and loss math stay fp32).", ("fp32", "bf16", "fp16"))
    gradient_checkpointing: bool = _f(False, "Recompute activations in the backward pass (policy and critic) to save memory.")
    logprob_chunk_size: int | None = _f(None, "Compute log-probs and entropies this many response tokens at a time: the LM head runs on one chunk of hidden states, and in training is recomputed chunk by chunk in the backward pass, so the float32 (tokens x vocabulary) logits of a whole micro-batch never exist (None = all at once).", low=1)
    torch_compile: bool = _f(False, "Compile the training forwards with torch.compile.")
    lora_r: int = _f(0, "LoRA rank (0 = train all weights). With LoRA the reference is the policy with its adapter disabled: no second copy.", low=0)
    lora_alpha: float = _f(16.0, "LoRA scaling alpha.", low=0.0, low_open=True)
    lora_dropout: float = _f(0.0, "LoRA dropout, in [0, 1): recorded in the saved adapter's config; during PPO it is switched off like every dropout, so the first update step is exactly on-policy.", low=0.0, high=1.0, high_open=True)
    lora_target_modules: str = _f("all-linear", "Modules that get LoRA adapters: all-linear, or a comma-separated list of module names.")
    output_dir: str = _f("runs/ppo", "Where metrics.jsonl, samples.jsonl and the final model are written.", resume="free")
    overwrite_output_dir: bool = _f(False, "Start over in an output_dir that already holds a run, removing the files the old run's run.json lists as its own (metrics, samples, config, checkpoints, final policy) and nothing else; or write a new run beside files that are not a run's (never over a file with a name the run writes).", resume="free")
    log_interval: int = _f(1, "Write metrics every this many iterations.", low=1, resume="free")
    eval_interval: int = _f(20, "Score the eval prompts and write samples every this many iterations (0 = off).", low=0, resume="free")
    eval_prompts: int = _f(16, "How many eval prompts to sample at each evaluation.", low=1, resume="free")
    save_interval: int = _f(0, "Write a checkpoint (weights, optimizer, scheduler, KL controllers, RNG, step) every this many iterations (0 = none); the final policy is always saved.", low=0, resume="free")
    keep_checkpoints: int = _f(2, "How many of the newest checkpoints to keep in output_dir/checkpoints.", low=1, resume="free")
    resume_from: str | None = _f(None, "Resume from a checkpoint folder, or 'latest' for the newest valid one in output_dir/checkpoints.", resume="free")
    max_bad_updates: int = _f(3, "Stop the run after this many updates skipped for nan or inf in rewards, losses or gradients.", low=1, resume="free")
    report_to: str | None = _f(None, "Also log to these trackers through accelerate (tensorboard, wandb, trackio; comma-separated).", resume="free")
    progress_bar: bool = _f(True, "Show a progress bar with reward and KL.", resume="free")

    def __post_init__(self):
        self._coerce_types()
        self.validate()

    # ----------------------------------------------------------------------------------
    def _coerce_types(self) -> None:
        """YAML and the command line give strings and ints; check and convert them."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            setattr(self, f.name, _convert(f.name, value, hints[f.name]))

    def validate(self) -> None:
        """Check every value and every relation between values; ValueError names the field."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices is not None and value not in choices:
                raise ValueError(f"PPOConfig.{f.name} = {value!r} is not allowed; valid values are: {', '.join(map(repr, choices))}")
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "range" in f.metadata and value is not None:
                optional = type(None) in typing.get_args(hints[f.name])
                _check_range(f.name, value, *f.metadata["range"], integer=_base_type(hints[f.name]) is int, optional=optional)
        from .estimators import ADVANTAGE_ESTIMATORS
        from .losses import POLICY_LOSSES

        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"PPOConfig.policy_loss = {self.policy_loss!r} is not allowed; valid values are: {', '.join(map(repr, sorted(POLICY_LOSSES)))}")

        if self.report_to:
            from accelerate.utils import LoggerType  # the trackers accelerate can log to

            known = [t.value for t in LoggerType]
            unknown = [t.strip() for t in self.report_to.split(",") if t.strip() not in known]
            if unknown:
                raise ValueError(f"PPOConfig.report_to = {self.report_to!r}: {unknown[0]!r} is not a tracker accelerate knows; valid values are: {', '.join(known)} (comma-separated)")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            valid = ", ".join(map(repr, sorted(ADVANTAGE_ESTIMATORS)))
            raise ValueError(f"PPOConfig.advantage_estimator = {self.advantage_estimator!r} is not allowed; valid values are: {valid}")
        if self.advantage_estimator == "gae" and self.critic == "none":
            raise ValueError("PPOConfig.critic = 'none' cannot be used with advantage_estimator = 'gae', which needs values; use 'separate' or 'shared', or a critic-free estimator (reinforce, rloo, grpo, dr_grpo, reinforce_pp, reinforce_pp_baseline)")
        if self.value_pooling != "token" and self.critic != "separate":
            raise ValueError(f"PPOConfig.value_pooling = {self.value_pooling!r} needs critic = 'separate' (got {self.critic!r})")
        if self.value_warmup_iterations and self.critic == "none":
            raise ValueError("PPOConfig.value_warmup_iterations needs a critic to warm up; critic = 'none' has none")
        if self.overwrite_output_dir and self.resume_from:
            raise ValueError(f"PPOConfig.overwrite_output_dir starts the run in output_dir over, resume_from = {self.resume_from!r} continues it; set one of them (to resume with a config that has overwrite_output_dir: true, add --overwrite_output_dir false)")
        if self.missing_eos_penalty is not None and self.missing_eos_score is not None:
            raise ValueError("PPOConfig.missing_eos_penalty and missing_eos_score both handle a response with no EOS; set one of them")
        if self.missing_eos_score is not None and not math.isfinite(self.missing_eos_score):
            raise ValueError(f"PPOConfig.missing_eos_score = {self.missing_eos_score!r} must be a finite number (or None)")
        if self.ignore_eos and (self.overlong_filter or self.overlong_buffer):
            raise ValueError("PPOConfig.ignore_eos makes every response exactly max_new_tokens long, so overlong_filter would remove every advantage and overlong_buffer would penalise every response alike; switch them off")
        if self.ignore_eos and (self.missing_eos_penalty is not None or self.missing_eos_score is not None):
            raise ValueError("PPOConfig.ignore_eos never lets a response stop, so missing_eos_penalty or missing_eos_score would hit every response; set them to None")
        if self.stop_after and self.stop_after >= self.max_new_tokens:
            raise ValueError(f"PPOConfig.stop_after = {self.stop_after} leaves no position where a response could stop (max_new_tokens = {self.max_new_tokens})")
        if self.advantage_estimator in GROUP_ESTIMATORS and self.responses_per_prompt < 2:
            raise ValueError(f"PPOConfig.advantage_estimator = {self.advantage_estimator!r} compares responses to the same prompt: set responses_per_prompt >= 2 (got {self.responses_per_prompt})")
        if self.dynamic_sampling and self.responses_per_prompt < 2:
            raise ValueError(f"PPOConfig.dynamic_sampling drops the groups whose responses all scored alike: set responses_per_prompt >= 2 (got {self.responses_per_prompt})")
        if self.overlong_buffer > self.max_new_tokens:
            raise ValueError(f"PPOConfig.overlong_buffer = {self.overlong_buffer} is longer than the budget max_new_tokens = {self.max_new_tokens}")
        if self.advantage_estimator == "reinforce_pp_baseline" and self.whiten_rewards:
            raise ValueError("PPOConfig.advantage_estimator = 'reinforce_pp_baseline' subtracts the group mean of the score from the score's token, which whiten_rewards has already rescaled and shifted; set whiten_rewards: false")
        if self.rollout_correction != "none" and self.old_logprobs == "sampling":
            raise ValueError(
                f"PPOConfig.rollout_correction = {self.rollout_correction!r} weights tokens by pi_old / pi_sampler, but old_logprobs = 'sampling' "
                "takes the sampler's log-probs as pi_old (the bypass form), where the PPO ratio already is the importance weight; "
                "use old_logprobs: forward (or auto), or rollout_correction: none"
            )
        if self.rollout_correction_low >= self.rollout_correction_high:
            raise ValueError(f"PPOConfig.rollout_correction_low = {self.rollout_correction_low!r} must be below rollout_correction_high = {self.rollout_correction_high!r}")
        from .disagreements import parse_reproduce

        if "gae-over-padding" in parse_reproduce(self.reproduce) and self.advantage_estimator != "gae":
            raise ValueError(f"PPOConfig.reproduce = 'gae-over-padding' changes the GAE recursion, but advantage_estimator = {self.advantage_estimator!r}; use 'gae'")
        self.check_divisibility(processes=1)

    def check_divisibility(self, processes: int) -> None:
        """Batch sizes must split evenly into minibatches, micro-batches and processes."""
        pairs = [
            ("rollout_batch_size", self.rollout_batch_size, "responses_per_prompt", self.responses_per_prompt),
            ("rollout_batch_size", self.rollout_batch_size, "minibatch_size", self.minibatch_size),
            ("minibatch_size", self.minibatch_size, "gradient_accumulation_steps", self.gradient_accumulation_steps),
        ]
        if processes > 1:
            pairs.append(("rollout_batch_size", self.rollout_batch_size, "the number of processes", processes))
            pairs.append(("minibatch_size", self.minibatch_size, "gradient_accumulation_steps x processes", self.gradient_accumulation_steps * processes))
        for a, av, b, bv in pairs:
            if av % bv:
                raise ValueError(f"PPOConfig: {a} = {av} is not divisible by {b} = {bv}")

    # ----------------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> PPOConfig:
        """Read a YAML mapping of field names to values; keyword overrides win.

        `path` may also name a preset shipped with the package (see `presets()`).
        """
        path = Path(path)
        if not path.exists() and (PRESETS / f"{path}.yaml").exists():
            path = PRESETS / f"{path}.yaml"
        if not path.exists():
            raise ValueError(f"config file {str(path)!r} does not exist (presets: {', '.join(presets())})")
        if path.is_dir():
            raise ValueError(f"config file {str(path)!r} is a folder; give a YAML file of PPOConfig fields")
        if path.stat().st_size > 1 << 20:
            raise ValueError(f"config file {str(path)!r} has {path.stat().st_size / 2**20:.0f} MB: not a YAML file of PPOConfig fields")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as err:
            raise ValueError(f"config file {str(path)!r} cannot be read: {err.strerror or err}") from None
        except UnicodeDecodeError:
            raise ValueError(f"config file {str(path)!r} is not a text file; give a YAML file of PPOConfig fields") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"config file {str(path)!r} is not valid YAML{where}: {problem}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping of field: value, got {type(data).__name__}")
        data.update(overrides)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> PPOConfig:
        unknown = _unknown_fields(data)
        if unknown:
            raise ValueError(unknown)
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One --flag per field, with its help text; every default is None (= not given)."""
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _base_type(hints[f.name])
            meta = f" (default: {f.default!r})"
            kwargs = {"default": None, "help": f.metadata["help"] + meta, "metavar": kind.__name__.upper()}
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
                kwargs.pop("metavar")
            spellings = dict.fromkeys([f"--{f.name}", f"--{f.name.replace('_', '-')}"])  # one flag when the name has no '_'
            parser.add_argument(*spellings, dest=f.name, type=str, **kwargs)

    @classmethod
    def from_args(cls, config_path: str | None, args: argparse.Namespace) -> PPOConfig:
        overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None}
        if config_path:
            return cls.from_yaml(config_path, **overrides)
        return cls.from_dict(overrides)


PRESETS = Path(__file__).parent / "presets"
# the estimators whose baseline is the other responses to the same prompt (responses_per_prompt >= 2)
GROUP_ESTIMATORS = ("rloo", "grpo", "dr_grpo", "reinforce_pp_baseline")


# chapter 10's algorithms, one preset each, all on the tiny model and the arithmetic task (offline)
ALGORITHM_PRESETS = ("ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo", "cispo")


def presets() -> list[str]:
    """Names of the preset configs shipped with the package (`ppo-lab train NAME`)."""
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def _base_type(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _convert(name: str, value, hint):
    optional = type(None) in typing.get_args(hint) or (isinstance(hint, types.UnionType) and type(None) in hint.__args__)
    kind = _base_type(hint)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise ValueError(f"PPOConfig.{name} must not be None (expected {kind.__name__})")
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
                return value.lower() in ("true", "yes", "1", "on")
            raise ValueError
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        raise ValueError(f"PPOConfig.{name} = {value!r} is not a valid {kind.__name__}") from None
    return value


def _check_range(name, v, low, high, low_open, high_open, integer=False, optional=False):
    if integer:
        if v < low or (high is not None and v > high):
            bound = f">= {low}" if high is None else f"from {low} to {high}"
            raise ValueError(f"PPOConfig.{name} = {v!r} must be an integer {bound}" + (" (or None)" if optional else ""))
        return
    ok = math.isfinite(v) and (v > low if low_open else v >= low) and (high is None or (v < high if high_open else v <= high))
    if not ok:
        lo = "(" if low_open else "["
        hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
        off = " (None switches it off)" if optional else ""
        raise ValueError(f"PPOConfig.{name} = {v!r} must be a finite number in {lo}{low:g}, {hi}{off}")


def _unknown_fields(data) -> str | None:
    """"unknown PPOConfig field(s): 'lamda' (did you mean 'lam'?)" for the names in `data` that
    are not fields (a renamed field points to its new name), or None when all are fields."""
    import difflib

    names = {f.name for f in dataclasses.fields(PPOConfig)}
    unknown = sorted(set(data) - names)
    if not unknown:
        return None

    def hint(u):
        new = RENAMED.get(u) or next(iter(difflib.get_close_matches(u, names, 1)), None)
        return f"{u!r} ({'renamed to' if u in RENAMED else 'did you mean'} {new!r}{'' if u in RENAMED else '?'})" if new else repr(u)

    return f"unknown PPOConfig field(s): {', '.join(hint(u) for u in unknown)}"


def _init_naming_unknown_fields(init):
    """Wrap the dataclass's __init__ so that PPOConfig(learnig_rate=1e-4) names the near miss
    (Python's own TypeError says only "unexpected keyword argument")."""

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        unknown = _unknown_fields(kwargs)
        if unknown:
            raise TypeError(unknown)
        init(self, *args, **kwargs)

    return checked


PPOConfig.__init__ = _init_naming_unknown_fields(PPOConfig.__init__)
