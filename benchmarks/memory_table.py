#!/usr/bin/env python3
"""What fits where: `estimate_memory`'s peak per GPU for 0.5B-8B shapes, one GPU against 8 under FSDP2.

    python benchmarks/memory_table.py            # prints the markdown table quoted in README.md

No weights and no GPU: the shapes are the published configs' sizes (`ModelShape.from_config`),
and every figure comes from `ppo_lab.memory.estimate_memory`. `tests/test_memory.py` checks that
the README quotes the table this script prints.

The workload per GPU is the same in both columns: 64 responses per iteration (each scored 16 at
a time), micro-batches of 4, 512-token prompts and 512-token responses, bf16 autocast with
float32 master weights and frozen weights in bf16 (`memory.frozen_weights: auto`), gradient
checkpointing and log-probs in chunks of 1024 positions. The critic and the reward model have
the policy's shape.
"""

from __future__ import annotations

from transformers import LlamaConfig, Qwen2Config

from ppo_lab import PPOConfig
from ppo_lab.memory import ModelShape, estimate_memory

SHAPES = {  # the sizes of each model's published config.json
    "Qwen2.5-0.5B": Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-1.5B": Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-3B": Qwen2Config(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-7B": Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "Llama-3-8B": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}
SETUPS = {  # (settings, whether a reward model of the policy's shape is loaded)
    "critic + reward model": ({"critic.design": "separate"}, True),
    "value head + reward model": ({"critic.design": "shared"}, True),
    "GRPO, reward function": ({"critic.design": "none", "advantage.estimator": "grpo", "sampling.responses_per_prompt": 8}, False),
    "LoRA r=16, value head + reward model": ({"critic.design": "shared", "lora.r": 16}, True),
}
COMMON = {
    "memory.precision": "bf16", "memory.gradient_checkpointing": True, "memory.logprob_chunk": 1024,
    "sampling.max_new_tokens": 512, "batch.forward": 16, "batch.accumulation_steps": 2,
}
GPU_GIB = 80


def peak_gib(shape: ModelShape, setup: str, processes: int, sharding: str) -> float:
    """The estimated peak per GPU (GiB) of one iteration of `setup` on `processes` GPUs."""
    settings, with_reward = SETUPS[setup]
    # the same work per GPU: 64 responses and minibatches of 8 (2 micro-batches of 4) each
    cfg = PPOConfig(**COMMON, **settings, **{"batch.rollout": 64 * processes, "batch.minibatch": 8 * processes})
    est = estimate_memory(cfg, shape, prompt_len=512, critic=shape, reward=shape if with_reward else None, processes=processes, sharding=sharding)
    return est.peak / 2**30


def table() -> str:
    """The markdown table: per model and setup, the peak on 1 GPU -> on each of 8 under FSDP2."""
    lines = ["| model | " + " | ".join(SETUPS) + " |", "|---|" + "---:|" * len(SETUPS)]
    for name, config in SHAPES.items():
        shape = ModelShape.from_config(config)
        cells = []
        for setup in SETUPS:
            one, eight = peak_gib(shape, setup, 1, "none"), peak_gib(shape, setup, 8, "fsdp2")
            mark = lambda gib: f"**{gib:.0f}**" if gib <= GPU_GIB else f"{gib:.0f}"  # noqa: E731
            cells.append(f"{mark(one)} → {mark(eight)}")
        lines.append(f"| {name} ({shape.params / 1e9:.1f}B) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
