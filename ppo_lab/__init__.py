"""PPO Lab: Proximal Policy Optimization for language models, as a library and a textbook.

The modules follow the book's chapters; every name exported here is explained in one of them:

=====================  ==============================================  =========
module                 what it holds                                   chapter
=====================  ==============================================  =========
`book`                 every chapter's set-up, glued numbers, checks   all
`logprobs`             log-probabilities and entropy from logits       1
`masked`               means, variances, whitening over real tokens    2
`policy_gradient`      reward-to-go and the REINFORCE surrogate        2
`importance`           importance weights, effective sample size       3
`gae`                  generalized advantage estimation                4
`value`                critic loss with value clipping                 4, 6
`kl`                   KL estimators k1/k2/k3 and the exact KL         5
`shaping`              per-token rewards: score plus KL penalty;       5, 10
                       the overlong penalty
`kl_control`           fixed, adaptive and PPO-penalty KL controllers  5, 6
`clipping`             the clipped surrogate objective; GSPO, CISPO    6, 10
`aggregation`          loss aggregation modes                          10
`registry`             name -> function tables                         4, 10
`estimators`           advantage-estimator registry (GAE, RLOO, ...)   4, 10
`dynamic_sampling`     DAPO's filter and collection of groups          10
`bandit`               a bandit with a known gradient, for estimators  10
`losses`               policy-loss registry, the loss of a micro-batch 7, 10
`update`               one PPO update in one screen (`ppo_update`)     7
`tasks`, `tiny`        offline tasks and the built-in tiny model       1, 7
`models`, `rewards`    the four roles: policy, reference, critic,      1, 7, 8
                       reward; the gold reward
`hf`                   helpers around transformers                     7
`sampling`             sampling (`Sampling`, `generate`)               1, 7
`decoding`             the decode step: growing or static KV cache,    9
                       replayed as a CUDA graph
`rollout`              scoring the sampled tokens with every model     1, 7
`batch`                the rollout batch (`Rollout`) and its padding   7
`objective`            where the config meets the math: advantages,    7
                       the loss of a micro-batch
`optimizer_step`       one optimizer step per minibatch                7, 9
`build`, `trainer`     building a run from its config; the PPO loop    7
`metrics`              rollout metrics and the health checks           7
`run_output`           a run's folder: metrics, samples, final policy  7
`config`, `cli`        `PPOConfig`, YAML and the command line          7
`config_groups`        the config's groups (policy, optim, ...)        7
`fields`               a setting's help, range and resume policy       7
`plotting`             one rollout, drawn; the training dashboard      1, 7
`reward_model`         Bradley-Terry reward models                     8
`reference_norm`       the score's scale, fixed from the reference     8
`dpo`                  the KL-regularised optimum and DPO              8
`checkpoint`, `resume` checkpoints and resuming a run exactly          9
`distributed`          several processes: shard, gather, no_sync       9
`sharding`             FSDP2: every role's weights split over the      9
                       processes; sharded checkpoints
`memory`               the memory of a PPO setup: estimate, measure    9
`lora`                 LoRA adapters; the reference without a copy     9
`syncs`                counting host-device synchronisations           9
`sampler`              the sampler beside the trainer                  9
`rollout_correction`   weights for the sampler/trainer gap (TIS, MIS)  9
`disagreements`        the other implementations' choices              A
`course`               the course's assignments and autograder         D
=====================  ==============================================  =========

The math is imported eagerly (it needs only torch); the trainer, which imports transformers and
accelerate, is imported on first use of its names (`ppo_lab.PPOTrainer`, ...).
"""

from .aggregation import AGGREGATION_MODES, aggregate_loss
from .clipping import cispo_policy_loss, clipped_policy_loss, gspo_policy_loss, kl_penalized_policy_loss
from .dynamic_sampling import informative_groups
from .estimators import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
)
from .gae import compute_gae
from .importance import effective_sample_size, importance_weights
from .kl import KL_ESTIMATORS, expected_loss_gradient, full_kl, kl_gradient, kl_penalty
from .kl_control import AdaptiveKLController, FixedKLController, PPOPenaltyKLController
from .logprobs import chunked_logprobs, entropy_from_logits, logprobs_from_logits
from .masked import masked_mean, masked_var, masked_whiten, response_mask
from .policy_gradient import discounted_returns, reinforce_loss
from .rollout_correction import correction_weights, gap_metrics
from .shaping import adjust_scores, last_real_index, overlong_penalty, reference_normalization, shape_rewards
from .value import clipped_value_loss, explained_variance
from .update import ppo_update

#: The package's version (pyproject.toml reads it from here).
__version__ = "0.1.0"

_LAZY = {
    "PPOConfig": "config",
    "Sampling": "sampling",
    "generate": "sampling",
    "POLICY_LOSSES": "losses",
    "get_policy_loss": "losses",
    "register_policy_loss": "losses",
    "PPOTrainer": "trainer",
    "Rollout": "batch",
    "plot_dashboard": "plotting",
    "load_metrics": "plotting",
    "bradley_terry_loss": "reward_model",
    "preference_pairs": "reward_model",
    "train_reward_model": "reward_model",
    "bradley_terry_labels": "reward_model",
    "sampled_preference_pairs": "reward_model",
    "dpo_loss": "dpo",
    "optimal_policy": "dpo",
    "train_dpo": "dpo",
    "reward_and_kl": "dpo",
    "kl_regularised_objective": "dpo",
    "SequenceClassifierReward": "rewards",
    "sequence_scores": "rewards",
    "get_task": "tasks",
    "tiny_model_path": "tiny",
    "estimate_memory": "memory",
    "ModelShape": "memory",
    "TensorMemory": "memory",
    "measure_iteration": "memory",
}


_LAZY_MODULES = {"bandit", "batch", "book", "build", "checkpoint", "cli", "config", "config_groups", "decoding", "disagreements", "distributed", "dpo", "fields", "hf", "lora", "losses", "memory", "metrics", "models", "objective", "optimizer_step", "plotting", "reference_norm", "registry", "resume", "reward_model", "rewards", "rollout", "run_output", "sampler", "sampling", "sharding", "syncs", "tasks", "tiny", "trainer"}


def __getattr__(name):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ppo_lab' has no attribute {name!r}")

__all__ = [
    *_LAZY,
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "KL_ESTIMATORS",
    "PPOPenaltyKLController",
    "__version__",
    "adjust_scores",
    "aggregate_loss",
    "chunked_logprobs",
    "cispo_policy_loss",
    "clipped_policy_loss",
    "clipped_value_loss",
    "compute_advantages",
    "compute_gae",
    "correction_weights",
    "discounted_returns",
    "effective_sample_size",
    "entropy_from_logits",
    "expected_loss_gradient",
    "explained_variance",
    "full_kl",
    "gap_metrics",
    "get_advantage_estimator",
    "gspo_policy_loss",
    "importance_weights",
    "informative_groups",
    "kl_gradient",
    "kl_penalized_policy_loss",
    "kl_penalty",
    "last_real_index",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "ppo_update",
    "register_advantage_estimator",
    "reference_normalization",
    "reinforce_loss",
    "response_mask",
    "shape_rewards",
]
