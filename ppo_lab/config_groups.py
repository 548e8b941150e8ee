"""The groups of `PPOConfig`, one per part of the code that reads them (chapter 7).

Each group is a keyword-only dataclass (`fields.group`): its fields carry their help, range and
resume policy, and `check()` states the relations inside the group. The relations across groups
are `PPOConfig.check`'s. The sampling group is `sampling.Sampling` itself, which `generate` reads.
"""

from __future__ import annotations

import math

from .aggregation import AGGREGATION_MODES
from .fields import Group, _f, group
from .kl import KL_ESTIMATORS
from .rollout_correction import CORRECTIONS, LEVELS
from .sampling import Sampling


@group("policy")
class Policy(Group):
    """The policy to train and its tokenizer (`build.build_roles`)."""

    model: str = _f("builtin:tiny", "Policy to train: a hub name (org/model, or org/model@revision), a local folder, or builtin:tiny (the offline default).")
    tokenizer: str | None = _f(None, "Tokenizer to use; defaults to the policy's.")
    trust_remote_code: bool = _f(False, "Allow model code from the hub to run (off unless you trust the source).")


@group("lora")
class Lora(Group):
    """LoRA adapters on the policy (`lora`); r = 0 trains every weight."""

    r: int = _f(0, "LoRA rank (0 = train all weights). With LoRA the reference is the policy with its adapter disabled: no second copy.", low=0)
    alpha: float = _f(16.0, "LoRA scaling alpha.", low=0.0, low_open=True)
    dropout: float = _f(0.0, "LoRA dropout, in [0, 1): recorded in the saved adapter's config; during PPO it is switched off like every dropout, so the first update step is exactly on-policy.", low=0.0, high=1.0, high_open=True)
    target_modules: str = _f("all-linear", "Modules that get LoRA adapters: all-linear, or a comma-separated list of module names.")


@group("critic")
class Critic(Group):
    """The critic: its design, its model, its learning rate and its loss (chapters 4 and 6)."""

    design: str = _f("separate", "Critic design: a separate model with a scalar head, a value head on the policy's backbone, or none (for critic-free estimators such as grpo and rloo).", ("separate", "shared", "none"))
    model: str | None = _f(None, "Initialise the separate critic from this model (hub name or folder, e.g. the reward model); default: the policy.")
    pooling: str = _f("token", "What the separate critic's head reads at position t: the hidden state at t, or the mean of the hidden states of the real tokens up to t.", ("token", "mean"))
    lr: float | None = _f(None, "The critic's own learning rate (separate critic, or the shared critic's value head); None = optim.lr.", low=0.0, low_open=True)
    warmup_iterations: int = _f(0, "Iterations at the start of the run that train only the critic (the policy is not updated; VAPO's value pretraining).", low=0)
    lam: float | None = _f(None, "GAE lambda for the critic's return targets (VAPO's decoupled lambda, e.g. 1.0); None = advantage.lam.", low=0.0, high=1.0)
    clip: float | None = _f(0.2, "Value clip range around the rollout values (None = off).", low=0.0)
    loss_coef: float = _f(0.5, "Weight of the value loss.", low=0.0)

    def check(self):
        if self.pooling != "token" and self.design != "separate":
            raise ValueError(f"critic.pooling = {self.pooling!r} needs critic.design = 'separate' (got {self.design!r})")
        if self.warmup_iterations and self.design == "none":
            raise ValueError("critic.warmup_iterations needs a critic to warm up; critic.design = 'none' has none")


@group("reward")
class Reward(Group):
    """Where the score comes from and what is done to it before shaping (chapters 5, 8, 10)."""

    source: str | None = _f(None, "Reward: a sequence-classification model (hub name or folder), or module:function for a Python callable; default: the task's gold reward.")
    label_index: int = _f(-1, "For a classification reward model with several labels, the logit used as the score.")
    clip: float | None = _f(None, "Clip scores to [-clip, clip] (None = off).", low=0.0, low_open=True)
    normalize: bool = _f(False, "Normalise scores to mean 0, std 1 over each rollout batch.")
    truncated_penalty: float | None = _f(None, "Subtract this from the score of a truncated response, one that ran out of tokens: no stop token (EOS or sampling.stop_token) at a position >= sampling.stop_after (None = off).", low=0.0)
    truncated_score: float | None = _f(None, "Replace the score of a truncated response (no stop token at a position >= sampling.stop_after) by this value (N and N+: -1; None = off).")
    reference_norm: str = _f("none", "Fix a gain and bias once, before training, from the scores of the reference policy's responses: mean-std gives them mean 0 and std 1 (OpenAI 2019), mean gives them mean 0 (N+ centres its SFT references); none = off.", ("none", "mean-std", "mean"))
    reference_samples: int = _f(256, "Responses sampled from the reference policy, to prompts drawn at random from the training prompts, to fit reference_norm.", low=2)
    overlong_buffer: int = _f(0, "DAPO's soft overlong punishment: a response in the last overlong_buffer tokens of sampling.max_new_tokens loses score linearly, up to overlong_penalty at the budget (0 = off).", low=0)
    overlong_penalty: float = _f(1.0, "The score lost by a response of exactly sampling.max_new_tokens tokens, with overlong_buffer.", low=0.0)

    def check(self):
        if self.truncated_penalty is not None and self.truncated_score is not None:
            raise ValueError("reward.truncated_penalty and reward.truncated_score both handle a truncated response; set one of them")
        if self.truncated_score is not None and not math.isfinite(self.truncated_score):
            raise ValueError(f"reward.truncated_score = {self.truncated_score!r} must be a finite number (or None)")


@group("data")
class Data(Group):
    """The task and the prompts (`build.build_task`)."""

    task: str = _f("sentiment", "Built-in task providing prompts and the gold reward.", ("sentiment", "arithmetic", "arithmetic-small"))
    prompts_file: str | None = _f(None, "Training prompts from a file instead of the task's: .jsonl or .json (JSON lines, the prompt under prompt_field), anything else one prompt per line.")
    eval_prompts_file: str | None = _f(None, "Eval prompts from a file (same formats); default: the task's eval prompts, or the training prompts when prompts_file is given.")
    prompt_field: str = _f("prompt", "The key of the prompt in each line of a .jsonl or .json prompts file (the TL;DR data of N+ calls it query).")


@group("sampler")
class Sampler(Group):
    """The sampler beside the trainer (chapter 9, `sampler.py`): where pi_old comes from, the
    correction weights for the gap, and the experiments that open a gap on purpose."""

    old_logprobs_from: str = _f("auto", "Where the rollout's log-probs pi_old (and a shared value head's values) come from: the logits the tokens were sampled from (no extra forward; with a sampler that differs from the trainer, verl's bypass form), a separate forward pass of the trainer (the decoupled form), or auto: sampling in fp32 when the sampler is the trainer, else forward.", ("auto", "sampling", "forward"))
    correction: str = _f("none", "Importance weights for the gap between the sampler's log-probs and the trainer's (decoupled form: needs old_logprobs_from forward, which auto picks): tis truncates rho = pi_old / pi_sampler at correction_high; mis (IcePop) keeps rho inside [correction_low, correction_high] and zeroes it outside.", CORRECTIONS)
    correction_level: str = _f("token", "The ratio the correction acts on: each token's, or each response's product over its tokens (the same weight for all its tokens).", LEVELS)
    correction_low: float = _f(0.0, "Lower bound of mis (IcePop uses 0.5).", low=0.0)
    correction_high: float = _f(2.0, "Upper bound of tis and mis (the TIS recipes use 2; IcePop 5).", low=1.0)
    noise: float = _f(0.0, "Experiments only: sample from a copy of the policy whose every weight is multiplied by (1 + noise x N(0, 1)), drawn afresh each iteration; a stand-in for an inference engine whose numerics differ from the trainer's.", low=0.0)
    precision: str = _f("same", "Experiments only: bf16 samples under bfloat16 autocast while the trainer's forwards keep memory.precision (the sampler/trainer gap of an fp32 trainer).", ("same", "bf16"))

    def check(self):
        if self.correction != "none" and self.old_logprobs_from == "sampling":
            raise ValueError(
                f"sampler.correction = {self.correction!r} weights tokens by pi_old / pi_sampler, but sampler.old_logprobs_from = 'sampling' "
                "takes the sampler's log-probs as pi_old (the bypass form), where the PPO ratio already is the importance weight; "
                "use sampler.old_logprobs_from: forward (or auto), or sampler.correction: none"
            )
        if self.correction_low >= self.correction_high:
            raise ValueError(f"sampler.correction_low = {self.correction_low!r} must be below sampler.correction_high = {self.correction_high!r}")


@group("batch")
class Batch(Group):
    """How many responses a rollout, a minibatch, a forward and a micro-batch hold (config.py's docstring)."""

    rollout: int = _f(64, "Responses sampled per PPO iteration (global: each of N processes samples rollout / N).", low=1)
    minibatch: int = _f(16, "Responses per optimizer step (global); must divide rollout.", low=1)
    forward: int | None = _f(None, "Responses per scoring forward in the rollout (policy, reference, critic), on each process; None = its whole share at once. Lower it on a GPU to bound the memory of the (responses x length x vocabulary) logits.", low=1)
    accumulation_steps: int = _f(1, "Micro-batches per minibatch on each process; a micro-batch holds minibatch / (accumulation_steps x processes) responses.", low=1)
    epochs: int = _f(4, "Passes over each rollout batch.", low=1)


@group("optim")
class Optim(Group):
    """The optimizer and one optimizer step (`build.build_optimizer`, `optimizer_step`)."""

    lr: float = _f(3e-4, "AdamW learning rate (policy and critic); the default suits the tiny offline model, hub models want 1e-6 to 1e-5.", low=0.0, low_open=True)
    schedule: str = _f("constant", "Learning-rate schedule after warmup.", ("constant", "linear", "cosine"))
    warmup_steps: int = _f(0, "Optimizer steps of linear warmup.", low=0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", low=0.0)
    adam_eps: float = _f(1e-8, "AdamW epsilon (PyTorch's default 1e-8; the published RLHF recipes use 1e-5).", low=0.0, low_open=True)
    max_grad_norm: float | None = _f(1.0, "Clip the gradient norm to this value (None = no clipping); one norm, or one per model (clip_scope).", low=0.0, low_open=True)
    clip_scope: str = _f("global", "Which gradients one norm covers: global, policy and critic together (CleanRL); per-model, the policy's and the critic's (or value head's) clipped each on its own (verl, OpenRLHF), so a large critic gradient does not shrink the policy's step.", ("global", "per-model"))
    early_stop_kl: float | None = _f(0.1, "Early stop: end an iteration's update before a minibatch whose policy/approx_kl (KL(old || new) per token, measured before its step) exceeds this (None = off).", low=0.0, low_open=True)


@group("loss")
class Loss(Group):
    """The policy loss and its terms (chapters 6 and 10; `losses`)."""

    policy: str = _f("clip", "Policy loss from the registry (ppo_lab.losses): clip, the clipped surrogate; ppo_penalty, the adaptive KL penalty to the old policy (PPO-penalty); gspo, clipping each response's geometric-mean ratio; cispo, a clipped stop-gradient importance weight on REINFORCE; or one registered by you.")
    clip_eps: float = _f(0.2, "Policy ratio clip range epsilon.", low=0.0, low_open=True)
    clip_eps_high: float | None = _f(None, "Upper ratio clip range (None = clip_eps).", low=0.0, low_open=True)
    dual_clip: float | None = _f(None, "Dual-clip constant c > 1 for negative advantages (None = off).", low=1.0, low_open=True)
    penalty_beta: float = _f(1.0, "Initial beta of PPO-penalty (policy = ppo_penalty).", low=0.0)
    penalty_target: float = _f(0.01, "Target KL(old || new) per token of PPO-penalty; beta doubles above 1.5x, halves below 1/1.5x.", low=0.0, low_open=True)
    entropy_coef: float = _f(0.0, "Weight of the entropy bonus.", low=0.0)
    aggregation: str = _f("token-mean", "How per-token losses are aggregated.", AGGREGATION_MODES)

    def check(self):
        from .losses import POLICY_LOSSES

        if self.policy == "kl_penalty":  # its name before: ppo_lab.kl_penalty is the KL estimate to the reference
            raise ValueError("loss.policy = 'kl_penalty' is now 'ppo_penalty' (PPO-penalty's loss)")
        if self.policy not in POLICY_LOSSES:
            raise ValueError(f"loss.policy = {self.policy!r} is not allowed; valid values are: {', '.join(map(repr, sorted(POLICY_LOSSES)))}")


@group("advantage")
class Advantage(Group):
    """The advantage estimator and what is done to its input and output (chapters 4 and 10)."""

    estimator: str = _f("gae", "Advantage estimator from the registry: gae, reinforce, rloo, grpo, dr_grpo, reinforce_pp, reinforce_pp_baseline, or one registered by you.")
    gamma: float = _f(1.0, "Discount factor.", low=0.0, high=1.0)
    lam: float = _f(0.95, "GAE lambda, for the policy's advantages.", low=0.0, high=1.0)
    whiten: bool = _f(True, "Normalise advantages to mean 0, std 1 over the real tokens of the batch.")
    whiten_rewards: bool = _f(False, "Scale the per-token shaped rewards to std 1 over the real tokens of the batch, keeping their mean (OpenAI 2019's whiten(rewards, shift_mean=False)).")
    drop_truncated: bool = _f(False, "DAPO's overlong filtering: a truncated response (it ran out of tokens, no stop token) gets advantage 0, so it adds no policy gradient (its tokens still count in the loss's normaliser).")

    def check(self):
        from .estimators import ADVANTAGE_ESTIMATORS

        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage.estimator = {self.estimator!r} is not allowed; valid values are: {', '.join(map(repr, sorted(ADVANTAGE_ESTIMATORS)))}")
        if self.estimator == "reinforce_pp_baseline" and self.whiten_rewards:
            raise ValueError("advantage.estimator = 'reinforce_pp_baseline' subtracts the group mean of the score from the score's token, which advantage.whiten_rewards has already rescaled and shifted; set advantage.whiten_rewards: false")


@group("kl")
class Kl(Group):
    """The KL penalty to the reference policy: its weight, estimator, place and controller (chapter 5)."""

    coef: float = _f(0.2, "Initial KL coefficient beta (per-token penalty weight).", low=0.0)
    estimator: str = _f("k1", "Per-token KL estimator.", KL_ESTIMATORS)
    placement: str = _f("reward", "Put the KL penalty in the per-token reward, or add it to the loss. In the loss, the estimator's gradient is what counts: k1 has expected gradient 0, k2 that of KL(pi || pi_ref), k3 that of KL(pi_ref || pi) (Tang and Munos 2025; chapter 10).", ("reward", "loss"))
    control: str = _f("fixed", "Keep beta fixed, or adapt it toward target.", ("fixed", "adaptive"))
    target: float = _f(6.0, "Target KL to the reference per response (adaptive control).", low=0.0, low_open=True)
    horizon: float = _f(10000.0, "Horizon of the adaptive controller, in responses.", low=0.0, low_open=True)


@group("memory")
class Memory(Group):
    """Precision and the memory savers (chapter 9; `memory`)."""

    precision: str = _f("fp32", "Mixed precision (bf16/fp16 on GPU; master weights and loss math stay fp32).", ("fp32", "bf16", "fp16"))
    gradient_checkpointing: bool = _f(False, "Recompute activations in the backward pass (policy and critic) to save memory.")
    logprob_chunk: int | None = _f(None, "Compute log-probs and entropies this many response tokens at a time: the LM head runs on one chunk of hidden states, and in training is recomputed chunk by chunk in the backward pass, so the float32 (tokens x vocabulary) logits of a whole micro-batch never exist (None = all at once).", low=1)
    compile: bool = _f(False, "Compile the training forwards with torch.compile.")
    sharding: str = _f("none", "How the roles' weights, gradients and optimizer state are split over the processes: 'none' (DDP: each process holds them whole) or 'fsdp2' (PyTorch FSDP2's fully_shard on every decoder block and model: each process holds 1/N; launch with accelerate launch or torchrun).", ("none", "fsdp2"))
    frozen_weights: str = _f("auto", "How the frozen weights (the reference, a reward model's backbone, a LoRA base) are stored: 'bf16' keeps in bfloat16 those that bf16 compute reads rounded anyway (the linear layers not tied to an embedding; under memory.sharding = 'fsdp2', every weight of a wholly frozen model), which halves them and leaves every forward bit for bit unchanged, so the first KL stays exactly 0; 'fp32' keeps them in float32; 'auto': 'bf16' when memory.precision is 'bf16', else 'fp32'. A LoRA policy's export merges the adapter into the rounded base, and a frozen model in bf16 runs under the trainer's autocast only.", ("auto", "fp32", "bf16"))
    cuda_allocator: str = _f("expandable", "CUDA only: 'expandable' turns on the caching allocator's expandable segments when the run starts (unless PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF is set), which keeps reserved memory near allocated memory (16.0 GiB reserved on the 271M GPU benchmark against 35.1 in the run before it; that one run was 9% slower, not settled); 'default' leaves the allocator as it is.", ("expandable", "default"), resume="free")


@group("run")
class Run(Group):
    """The run itself: seed, length, output, logging, evaluation, checkpoints (mostly free on resume)."""

    seed: int = _f(0, "Random seed (0 to 2**32 - 1, the range NumPy accepts).", low=0, high=2**32 - 1)
    iterations: int = _f(60, "PPO iterations (rollout + update) to run.", low=1, resume="free")
    output_dir: str = _f("runs/ppo", "Where metrics.jsonl, samples.jsonl and the final model are written.", resume="free")
    overwrite: bool = _f(False, "Start over in an output_dir that already holds a run, removing the files the old run's run.json lists as its own (metrics, samples, config, checkpoints, final policy) and nothing else; or write a new run beside files that are not a run's (never over a file with a name the run writes).", resume="free")
    log_interval: int = _f(1, "Write metrics every this many iterations.", low=1, resume="free")
    eval_interval: int = _f(20, "Score the eval prompts and write samples every this many iterations (0 = off).", low=0, resume="free")
    eval_count: int = _f(16, "How many eval prompts to sample at each evaluation.", low=1, resume="free")
    save_interval: int = _f(0, "Write a checkpoint (weights, optimizer, scheduler, KL controllers, RNG, iteration) every this many iterations (0 = none); the final policy is always saved.", low=0, resume="free")
    keep_checkpoints: int = _f(2, "How many of the newest checkpoints to keep in output_dir/checkpoints.", low=1, resume="free")
    resume_from: str | None = _f(None, "Resume from a checkpoint folder, or 'latest' for the newest valid one in output_dir/checkpoints.", resume="free")
    max_bad_updates: int = _f(3, "Stop the run after this many updates skipped for nan or inf in rewards, losses or gradients.", low=1, resume="free")
    report_to: str | None = _f(None, "Also log to these trackers through accelerate (tensorboard, wandb, trackio; comma-separated).", resume="free")
    progress_bar: bool = _f(True, "Show a progress bar with reward and KL.", resume="free")
    reproduce: str | None = _f(None, "Reproduce other implementations' choices where they disagree with ppo_lab's (Appendix A; off by default, never for real training): comma-separated from score-past-last, gae-over-padding, whiten-with-padding, temperature-1-in-scoring, dropout-on (see ppo_lab.disagreements).")

    def check(self):
        if self.overwrite and self.resume_from:
            raise ValueError(f"run.overwrite starts the run in output_dir over, run.resume_from = {self.resume_from!r} continues it; set one of them (to resume with a config that has overwrite: true, add --run.overwrite false)")
        if self.report_to:
            from accelerate.utils import LoggerType  # the trackers accelerate can log to

            known = [t.value for t in LoggerType]
            unknown = [t.strip() for t in self.report_to.split(",") if t.strip() not in known]
            if unknown:
                raise ValueError(f"run.report_to = {self.report_to!r}: {unknown[0]!r} is not a tracker accelerate knows; valid values are: {', '.join(known)} (comma-separated)")
        from .disagreements import parse_reproduce

        parse_reproduce(self.reproduce)


GROUPS = {cls.key: cls for cls in (Policy, Lora, Critic, Reward, Data, Sampling, Sampler, Batch, Optim, Loss, Advantage, Kl, Memory, Run)}
