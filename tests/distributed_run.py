"""Run by tests/test_distributed.py under `accelerate launch`: a short PPO run, results to JSON."""

import json
import sys

import torch

from ppo_lab import PPOConfig, PPOTrainer


# the published recipes' details (reference normalisation sampled in shards, reward whitening,
# per-model clipping after the all-reduce, the replacement score) on top of the base run
RECIPE = {
    "reward.reference_norm": "mean-std", "reward.reference_samples": 15, "advantage.whiten_rewards": True,
    "optim.clip_scope": "per-model", "reward.truncated_score": -1.0, "optim.max_grad_norm": 0.5,
}


def run(output_dir: str, accumulation: int, variant: str = "base") -> dict:
    torch.set_num_threads(1)
    cfg = PPOConfig(**RECIPE if variant == "recipe" else {}, **{
            "batch.rollout": 16, "batch.minibatch": 8, "batch.epochs": 2, "sampling.max_new_tokens": 8,
            "run.iterations": 2, "run.eval_interval": 0, "run.progress_bar": False,
            "run.output_dir": output_dir, "run.overwrite": True, "batch.accumulation_steps": accumulation,
            "optim.schedule": "linear", "kl.control": "adaptive", "kl.horizon": 64,
        })
    trainer = PPOTrainer(cfg)
    history = trainer.train()
    weights = trainer.accelerator.unwrap_model(trainer.policy).state_dict()
    return {
        "processes": trainer.accelerator.num_processes,
        "history": history,
        "kl_coef": trainer.kl_ctl.value,
        "score_map": [trainer.score_gain, trainer.score_bias],
        "weights": {k: v.double().sum().item() for k, v in weights.items()},
        "is_main": trainer.accelerator.is_main_process,
    }


if __name__ == "__main__":
    result = run(sys.argv[1], int(sys.argv[2]), sys.argv[4] if len(sys.argv) > 4 else "base")
    if result.pop("is_main"):
        with open(sys.argv[3], "w") as fh:
            json.dump(result, fh)
