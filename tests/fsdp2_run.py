"""Run by tests/test_sharding.py under `accelerate launch`: a short sharded PPO run, results to JSON."""

import json
import sys

import torch

from ppo_lab import PPOConfig, PPOTrainer


def run(output_dir: str, accumulation: int, sharding: str, extra: dict | None = None) -> dict:
    """3 iterations; the policy's full weights go to output_dir/weights.pt (main process)."""
    torch.set_num_threads(1)
    cfg = PPOConfig(**(extra or {}), **{
            "batch.rollout": 16, "batch.minibatch": 8, "batch.epochs": 2, "sampling.max_new_tokens": 8,
            "run.iterations": 3, "run.eval_interval": 0, "run.progress_bar": False, "run.output_dir": output_dir,
            "run.overwrite": True, "batch.accumulation_steps": accumulation, "memory.sharding": sharding,
        })
    trainer = PPOTrainer(cfg)
    history = trainer.train()
    from ppo_lab.memory import TensorMemory

    held = TensorMemory().hold(trainer.policy, trainer.critic, getattr(trainer.optimizer, "optimizer", trainer.optimizer)).current
    reward_model = getattr(trainer.reward_fn, "model", None)  # (a reward model's backbone is sharded, its score head whole)
    reward_held = TensorMemory().hold(reward_model).current if reward_model is not None else 0
    state = trainer.sharding.full_state_dict(trainer.policy, trainer.lm)
    weights = state if state is not None else trainer.lm.state_dict()
    if trainer.accelerator.is_main_process:
        torch.save({k: v.detach().clone().cpu() for k, v in weights.items()}, f"{output_dir}/weights.pt")
    return {
        "processes": trainer.accelerator.num_processes,
        "held_bytes": held,  # this process's weights, gradients and AdamW state (the main process's)
        "reward_bytes": reward_held,
        "history": history,
        "weights": {k: v.double().sum().item() for k, v in weights.items()},
        "is_main": trainer.accelerator.is_main_process,
    }


if __name__ == "__main__":
    result = run(sys.argv[1], int(sys.argv[2]), sys.argv[4], json.loads(sys.argv[5]) if len(sys.argv) > 5 else None)
    if result.pop("is_main"):
        with open(sys.argv[3], "w") as fh:
            json.dump(result, fh)
