"""Run by tests/test_sharding.py under `accelerate launch`: each process's measured peak of one
sharded iteration beside `estimate_memory`'s (JSON to argv[2], one row per setting and process)."""

import json
import sys

import torch

from ppo_lab import PPOConfig, PPOTrainer
from ppo_lab.memory import ModelShape, estimate_memory, measure_iteration

BASE = {
    "batch.rollout": 64, "batch.minibatch": 16, "sampling.max_new_tokens": 12, "batch.epochs": 1, "optim.early_stop_kl": None,
    "run.progress_bar": False, "run.eval_interval": 0, "memory.sharding": "fsdp2",
}
CASES = {
    "separate critic": {},
    "bf16, frozen bf16": {"memory.precision": "bf16"},
    "shared critic, lora": {"critic.design": "shared", "lora.r": 8},
    "bf16, chunked log-probs": {"memory.precision": "bf16", "memory.logprob_chunk": 16},
}


def main(root: str, out: str) -> None:
    torch.set_num_threads(1)
    rows = []
    for i, (name, settings) in enumerate(CASES.items()):
        trainer = PPOTrainer(PPOConfig(**BASE, **settings, **{"run.output_dir": f"{root}/{i}"}))
        trainer.iterate()  # AdamW's moments exist from the first step on
        rollout_peak, update_peak, ro = measure_iteration(trainer)
        n = trainer.accelerator.num_processes
        est = estimate_memory(trainer.config, ModelShape.of(trainer.lm), prompt_len=ro.query_ids.shape[1], response_len=ro.response_ids.shape[1], processes=n, sharding="fsdp2")
        rows.append({"case": name, "rank": trainer.accelerator.process_index, "rollout": rollout_peak, "update": update_peak,
                     "est_rollout": sum(est.rollout.values()), "est_update": sum(est.update.values()),
                     "est": {"rollout": est.rollout, "update": est.update}})
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, rows)
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump([r for rs in gathered for r in rs], fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
