"""Count host-device synchronisations per PPO iteration (see `ppo_lab.syncs`).

    python benchmarks/count_syncs.py            # the default config and the Qwen preset's batch shape

Runs on the CPU with the tiny model. "qwen-shape" uses the Qwen2.5 preset's batch arithmetic
(64 responses of up to 32 tokens, minibatches of 16 in 2 micro-batches, 2 epochs, a value
head on the policy, a missing-EOS penalty) on the tiny model: the count depends on the loop
structure, not on the model's size. bf16 is left out (the CPU count is the same).
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from ppo_lab import PPOConfig, PPOTrainer
from ppo_lab.syncs import SyncCounter

SHAPES = {
    "default": {},
    "qwen-shape": {
        "critic.design": "shared", "sampling.max_new_tokens": 32, "sampling.stop_token": None,
        "batch.rollout": 64, "batch.minibatch": 16, "batch.accumulation_steps": 2, "batch.epochs": 2,
        "optim.schedule": "linear", "optim.warmup_steps": 10, "kl.coef": 0.05,
        "reward.truncated_penalty": 1.0,
    },
}


def count(shape: str, iterations: int = 3) -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        cfg = PPOConfig(**SHAPES[shape], **{
                "run.output_dir": out, "run.progress_bar": False, "run.eval_interval": 0,
                "run.iterations": iterations,
            })
        trainer = PPOTrainer(cfg)
        trainer.iterate()  # the first iteration: warm-up, not counted
        rows = []
        for _ in range(iterations - 1):
            with SyncCounter() as syncs:
                sampler = trainer.rollout

                def rollout(prompts, _sampler=sampler):
                    syncs.phase = "rollout"
                    try:
                        return _sampler(prompts)
                    finally:
                        syncs.phase = "update and metrics"

                trainer.rollout = rollout
                metrics = trainer.iterate()
                trainer.rollout = sampler
            rows.append((syncs.total, dict(syncs.by_phase), dict(syncs.by_origin), dict(syncs.by_op), metrics["response/length_mean"], metrics["policy/steps"]))
    return {"shape": shape, "iterations": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="*", default=list(SHAPES))
    args = parser.parse_args(argv)
    for shape in args.shapes:
        result = count(shape)
        for total, phases, origins, ops, length, steps in result["iterations"]:
            print(f"{shape}: {total} per iteration (mean response {length:.1f} tokens, {steps:.0f} optimizer steps)")
            print(f"    by phase: {phases}")
            print(f"    by caller: {origins}")
            print(f"    by op: {dict(sorted(ops.items(), key=lambda kv: -kv[1]))}")


if __name__ == "__main__":
    sys.exit(main())
