"""Run by tests/test_sharding.py under `accelerate launch`: a sharded run with a checkpoint at
every iteration, then a second trainer resumed from its second checkpoint (JSON to argv[2])."""

import json
import sys

import torch

from ppo_lab import PPOConfig, PPOTrainer

SETTINGS = {
    "batch.rollout": 16, "batch.minibatch": 8, "batch.epochs": 2, "sampling.max_new_tokens": 8,
    "run.iterations": 3, "run.eval_interval": 0, "run.progress_bar": False, "run.save_interval": 1,
    "run.keep_checkpoints": 3, "critic.clip": None,
}


def main(output_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    cfg = PPOConfig(**SETTINGS, **{"run.output_dir": output_dir, "memory.sharding": "fsdp2"})
    unbroken = PPOTrainer(cfg)
    history = unbroken.train()
    weights = unbroken.sharding.full_state_dict(unbroken.policy, unbroken.lm)
    checkpoint = sorted((unbroken.output_dir / "checkpoints").glob("checkpoint-*"))[1]  # after iteration 2
    resumed = PPOTrainer(cfg.replace({"run.resume_from": str(checkpoint)}))
    assert resumed.iteration == 2
    again = resumed.train()
    weights_again = resumed.sharding.full_state_dict(resumed.policy, resumed.lm)
    if unbroken.accelerator.is_main_process:
        same = all(torch.equal(weights[k], weights_again[k]) for k in weights)
        with open(out, "w") as fh:
            json.dump({"unbroken": history[-1], "resumed": again[-1], "same_weights": same, "checkpoint": str(checkpoint),
                       "weights": {k: v.double().sum().item() for k, v in weights.items()}}, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
