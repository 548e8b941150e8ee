#!/usr/bin/env python3
"""TRL's GRPOTrainer (trl 1.12.0, without vLLM) on the benchmark's models, with the GRPO preset's algorithm.

The live baseline a practitioner reaches for now that TRL's PPO is gone: `trl.GRPOTrainer` with
generation by transformers' `generate` (`use_vllm=False`), on the same random-init policy and
reward model as the PPO runners (workload.py), and the algorithm of `ppo_lab/presets/grpo.yaml`:
`--group` responses per prompt, group-normalised rewards (`scale_rewards="group"`), the k3 KL in
the loss at `--kl-coef` (`beta`), clip 0.2, the mean over each response's tokens
(`loss_type="grpo"`, ppo_lab's seq-mean-token-mean). One update is one generation batch of
`--batch` responses followed by `--ppo-epochs` passes (`num_iterations`) over `--mini-batches`
optimizer steps (`steps_per_generation`), the shape of ppo_lab's `--algorithm grpo` run.

Responses have a fixed length (`min_new_tokens` = `max_new_tokens`), like the PPO runners'. The
policy is saved to a temporary folder and passed by path, because TRL loads its reference model
from the policy's `name_or_path`; both load in float32 (TRL's default), and `--precision bf16`
sets ACCELERATE_MIXED_PRECISION=bf16 and `bf16=True` as in trl_ppo.py.

Per-update wall time is the interval between every (mini-batches x epochs)-th `on_step_end`;
`_generate` (the sampling itself) and `_generate_and_score_completions` (sampling, the reward
and the old / reference log-probs) are timed by wrapping them. Prints one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import workload as wl  # sets the offline environment before transformers is imported

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    wl.add_workload_args(p)
    p.add_argument("--group", type=int, default=8, help="responses per prompt (num_generations)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    wl.setup_process(args)
    t_start = time.perf_counter()
    bf16 = args.precision == "bf16"
    if bf16:
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"  # as trl_ppo.py: TRL's Accelerator() reads it
    if args.batch % args.group or args.batch % args.mini_batches:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --group {args.group} and of --mini-batches {args.mini_batches}")

    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.set_seed(args.seed)
    tok, words = wl.make_tokenizer(args.vocab, args.seed)
    texts = wl.make_prompt_texts(words, args.n_prompts, args.prompt_min, args.prompt_max, args.seed)
    prompt_ids = wl.make_prompt_ids(tok, texts)
    tmp = Path(tempfile.mkdtemp(prefix="bench_trl_grpo_"))
    policy = wl.make_policy(tok, args)
    wl.no_dropout(policy)
    reward = wl.make_reward_model(tok, args)
    n_matmul = {"policy": wl.matmul_params(policy), "reward": wl.matmul_params(reward)}
    n_total = {"policy": wl.n_params(policy), "reward": wl.n_params(reward)}
    policy.save_pretrained(tmp / "policy")
    tok.save_pretrained(tmp / "policy")
    del policy

    steps_per_update = args.mini_batches * args.ppo_epochs
    config = GRPOConfig(
        output_dir=str(tmp / "out"), seed=args.seed, data_seed=args.seed, learning_rate=args.lr,
        per_device_train_batch_size=args.batch // args.mini_batches, gradient_accumulation_steps=1,
        steps_per_generation=args.mini_batches, num_iterations=args.ppo_epochs, num_generations=args.group,
        max_completion_length=args.response_length, generation_kwargs={"min_new_tokens": args.response_length},
        temperature=args.temperature, beta=args.kl_coef, epsilon=0.2, loss_type="grpo", scale_rewards="group",
        use_vllm=False, disable_dropout=True, max_steps=args.updates * steps_per_update,
        bf16=bf16, fp16=False, use_cpu=args.device == "cpu", gradient_checkpointing=False,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        log_completions=False,
    )
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    phases: dict[str, list[float]] = {"sampling": [], "rollout": []}

    def timed(name, fn):
        def wrapped(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            phases[name].append(time.perf_counter() - t0)
            return out
        return wrapped

    memory = wl.GpuMemory()

    class UpdateTimer(TrainerCallback):
        def __init__(self):
            self.update_s: list[float] = []
            self.logs: list[dict] = []
            self.steps = 0
            self.last = None

        def on_train_begin(self, a, state, control, **kw):
            memory.reset()
            self.last = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.steps += 1
            if self.steps % steps_per_update == 0:
                sync()
                now = time.perf_counter()
                self.update_s.append(now - self.last)
                memory.mark()
                self.last = now

        def on_log(self, a, state, control, logs=None, **kw):
            if logs:
                self.logs.append(dict(logs))

    timer = UpdateTimer()
    with contextlib.redirect_stdout(sys.stderr):
        trainer = GRPOTrainer(
            model=str(tmp / "policy"), reward_funcs=reward, args=config, train_dataset=Dataset.from_dict({"prompt": texts}),
            processing_class=tok, reward_processing_classes=tok, callbacks=[timer],
        )
        trainer._generate = timed("sampling", trainer._generate)
        trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)
        trl_mixed_precision = str(trainer.accelerator.mixed_precision)
        t_train = time.perf_counter()
        trainer.train()
        t_end = time.perf_counter()
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        optimizer = f"{type(opt).__name__}(fused={opt.defaults.get('fused')}, foreach={opt.defaults.get('foreach')})"
    shutil.rmtree(tmp, ignore_errors=True)
    if len(timer.update_s) != args.updates:
        raise RuntimeError(f"timed {len(timer.update_s)} updates, expected {args.updates}")
    if len(phases["rollout"]) != args.updates:
        raise RuntimeError(f"TRL generated {len(phases['rollout'])} times in {args.updates} updates: the batch shapes do not line up")

    rollout, update_s = phases["rollout"], timer.update_s
    last = next((log for log in reversed(timer.logs) if "reward" in log), {})  # (the very last is the run's summary)
    result = {
        "bench": "trl_grpo",
        **wl.environment(),
        "config": vars(args),
        **wl.timing_fields(update_s, args),
        "phase_median_s": {
            "sampling": round(wl.median_after_first(phases["sampling"]), 4),
            "rollout": round(wl.median_after_first(rollout), 4),
            "update": round(wl.median_after_first([u - r for u, r in zip(update_s, rollout)]), 4),
        },
        "algorithm": "grpo",
        "optimizer_steps_per_update": steps_per_update,
        "params": n_total,
        "params_matmul": n_matmul,
        "prompt_mean_tokens": round(wl.prompt_mean_length(prompt_ids), 2),
        "flops_per_update": wl.update_flops(args, n_matmul["policy"], 0, n_matmul["reward"], wl.prompt_mean_length(prompt_ids)),
        "precision": args.precision,
        "trl_mixed_precision": trl_mixed_precision,
        "optimizer": optimizer,
        **memory.fields(),
        "setup_s": round(t_train - t_start, 3),
        "train_wall_s": round(t_end - t_train, 3),
        "peak_rss_mb": round(wl.peak_rss_mb(), 1),
        "final_metrics": {k: last.get(k) for k in ("reward", "kl", "loss", "completions/mean_length")},
    }
    wl.emit(result)


if __name__ == "__main__":
    main()
