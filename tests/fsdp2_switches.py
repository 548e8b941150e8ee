"""Run by tests/test_sharding.py under `accelerate launch`: the trainer's switches with FSDP2, each
2 iterations with evaluation and a checkpoint at each, then resumed (JSON to argv[2])."""

import json
import sys

import torch

from ppo_lab import PPOConfig, PPOTrainer

BASE = {
    "batch.rollout": 16, "batch.minibatch": 8, "batch.epochs": 2, "sampling.max_new_tokens": 8, "run.iterations": 2,
    "run.eval_interval": 1, "run.eval_count": 4, "run.save_interval": 1, "run.progress_bar": False, "memory.sharding": "fsdp2",
}
CASES = {
    "bf16, separate critic": {"memory.precision": "bf16"},
    "bf16, shared critic": {"memory.precision": "bf16", "critic.design": "shared"},
    "gradient checkpointing": {"memory.gradient_checkpointing": True},
    "grpo, no critic": {"critic.design": "none", "advantage.estimator": "grpo", "sampling.responses_per_prompt": 4},
    "batch.forward and accumulation": {"batch.forward": 4, "batch.accumulation_steps": 2},
    "bf16, lora, shared critic": {"memory.precision": "bf16", "lora.r": 4, "critic.design": "shared"},
    "chunked log-probs, lora": {"memory.logprob_chunk": 5, "lora.r": 4},
    "bf16, reward model, frozen weights in bf16": {"memory.precision": "bf16", "reward.source": "REWARD_MODEL"},
    # 129 samples: shares of 65 and 64, two and one of the reward model's batches of 64, which sharded
    # must be as many forwards on every process (the shares are padded to 65)
    "reference score norm, shared critic": {"reward.reference_norm": "mean-std", "reward.reference_samples": 129, "critic.design": "shared",
                                            "reward.source": "REWARD_MODEL"},
}


def backbone(reward_fn) -> torch.nn.Module:
    """A reward model's backbone (its score head left out); an empty module for a function."""
    model = getattr(reward_fn, "model", None)
    return getattr(model, model.base_model_prefix) if model is not None else torch.nn.Module()


def main(root: str, out: str, reward_model: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for i, (name, settings) in enumerate(CASES.items()):
        settings = {k: reward_model if v == "REWARD_MODEL" else v for k, v in settings.items()}
        cfg = PPOConfig(**BASE, **settings, **{"run.output_dir": f"{root}/{i}"})
        trainer = PPOTrainer(cfg)
        history = trainer.train()
        resumed = PPOTrainer(cfg.replace({"run.resume_from": "latest"}))
        trained, loaded = (t.sharding.full_state_dict(t.policy, t.lm) for t in (trainer, resumed))
        results[name] = {
            "iterations": [m["iteration"] for m in history], "steps": [m["policy/steps"] for m in history],
            "first_kl": history[0]["objective/kl"], "eval": "eval/score_mean" in history[-1],
            "resumed_at": resumed.iteration, "kl_coef_equal": resumed.kl_ctl.value == trainer.kl_ctl.value,
            "policy_saved": (trainer.output_dir / "policy" / "config.json").is_file(),
            "same_weights": all(torch.equal(trained[k], loaded[k]) for k in trained),  # (the main process's whole copies)
            "score_map": [trainer.score_gain, trainer.score_bias], "resumed_score_map": [resumed.score_gain, resumed.score_bias],
            # the frozen weights' dtypes: the reference's, a LoRA base's (frozen part of the policy), the reward backbone's
            "frozen_dtypes": sorted({str(p.dtype) for m in (trainer.reference, trainer.policy, backbone(trainer.reward_fn)) for p in m.parameters() if not p.requires_grad}),
        }
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
