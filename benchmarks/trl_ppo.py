#!/usr/bin/env python3
"""TRL's PPOTrainer (trl 1.12.0, `trl.experimental.ppo`) on the benchmark's workload.

TRL 1.12.0 is the last release with PPO (1.13.0 deleted it). Notes for transformers 5.x:
`PPOConfig` defaults to bf16=True, which fails on a CPU-only machine, so it is turned off;
the dataset must be pre-tokenized (`input_ids`) and left-padded by the collator; the
reference model must be a distinct object; `num_sample_generations=0` keeps TRL's debug
generations out of the timed loop; `stop_token=None` gives fixed-length responses.

Per-update wall time is the interval between successive `on_step_end` callbacks. The phases
are cut by wrapping two functions of TRL's module: `batch_generation` (generate) and
`forward` (its first call with gradients on marks the start of the optimisation), and TRL's
per-update `gc.collect()` calls are timed separately. Prints one JSON line on stdout; TRL's
own output goes to stderr.

On a GPU (`--device cuda`, used by gpu.py): `use_cpu=False`, and `--precision bf16` sets
`bf16=True`. TRL 1.12's PPOTrainer builds its own `Accelerator()` without a mixed-precision
argument, and transformers 5.x's TrainingArguments no longer exports ACCELERATE_MIXED_PRECISION,
so `bf16=True` alone leaves everything in fp32; this runner sets
ACCELERATE_MIXED_PRECISION=bf16 first, which is what `accelerate launch --mixed_precision bf16`
does (the JSON line's `trl_mixed_precision` is what the trainer's accelerator ended up with).
The weights stay fp32 (master weights and AdamW state), and only the prepared policy+value
wrapper's forward (the training forward) runs under bf16 autocast: TRL's rollout calls
`unwrapped.policy.generate`, the reference, the value backbone and the reward model directly,
in fp32. `--rollout-autocast` also puts the rollout (generation, the reference / value / reward
forwards) under bf16 autocast, as ppo_lab does (bench name `trl_rollout_bf16`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import sys
import tempfile
import time

import workload as wl  # sets the offline environment before transformers is imported

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    wl.add_workload_args(p)
    p.add_argument("--rollout-autocast", action="store_true",
                   help="run TRL's rollout forwards under bf16 autocast too (needs --precision bf16)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    wl.setup_process(args)
    t_start = time.perf_counter()
    bf16 = args.precision == "bf16"
    if args.rollout_autocast and not bf16:
        raise SystemExit("--rollout-autocast needs --precision bf16")
    if bf16:
        # what `accelerate launch --mixed_precision bf16` sets; TRL's own Accelerator() reads it
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"

    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback

    import trl.experimental.ppo.ppo_trainer as trl_ppo
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    transformers.set_seed(args.seed)
    tok, words = wl.make_tokenizer(args.vocab, args.seed)
    texts = wl.make_prompt_texts(words, args.n_prompts, args.prompt_min, args.prompt_max, args.seed)
    prompt_ids = wl.make_prompt_ids(tok, texts)
    dataset = Dataset.from_dict({"input_ids": prompt_ids})
    policy = wl.make_policy(tok, args)
    reference = wl.make_policy(tok, args)  # same weights, a distinct object
    value = wl.make_value_model(tok, args)
    reward = wl.make_reward_model(tok, args)
    n_matmul = {"policy": wl.matmul_params(policy), "value": wl.matmul_params(value), "reward": wl.matmul_params(reward)}
    n_total = {"policy": wl.n_params(policy), "value": wl.n_params(value), "reward": wl.n_params(reward)}

    out_dir = tempfile.mkdtemp(prefix="bench_trl_ppo_")
    config = PPOConfig(
        output_dir=out_dir,
        seed=args.seed,
        data_seed=args.seed,
        learning_rate=args.lr,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        num_mini_batches=args.mini_batches,
        num_ppo_epochs=args.ppo_epochs,
        local_rollout_forward_batch_size=args.batch,
        response_length=args.response_length,
        total_episodes=args.updates * args.batch,
        temperature=args.temperature,
        kl_coef=args.kl_coef,
        stop_token=None,
        missing_eos_penalty=None,
        num_sample_generations=0,
        bf16=bf16,
        fp16=False,
        use_cpu=args.device == "cpu",
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    # --- phase timers ------------------------------------------------------------------------
    marks: dict[str, float] = {}
    phases: dict[str, list[float]] = {"generate": [], "score": [], "optimise": [], "other": []}
    real_generation, real_forward = trl_ppo.batch_generation, trl_ppo.forward

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)  # (phase cuts on a GPU)

    def batch_generation(*a, **k):
        sync()
        marks["gen_start"] = time.perf_counter()
        out = real_generation(*a, **k)
        sync()
        marks["gen_end"] = time.perf_counter()
        return out

    def forward(*a, **k):
        if torch.is_grad_enabled() and "opt_start" not in marks:
            sync()
            marks["opt_start"] = time.perf_counter()
        return real_forward(*a, **k)

    trl_ppo.batch_generation, trl_ppo.forward = batch_generation, forward
    if args.rollout_autocast:
        device_type = "cuda" if args.device == "cuda" else "cpu"

        def autocast(fn):
            def wrapped(*a, **k):
                with torch.autocast(device_type, dtype=torch.bfloat16):
                    return fn(*a, **k)
            return wrapped

        # generation, and the reference / value / reward forwards of the rollout (the training
        # forward goes through `forward` too, already under accelerate's autocast: no change)
        trl_ppo.batch_generation = autocast(trl_ppo.batch_generation)
        trl_ppo.forward = autocast(trl_ppo.forward)
        trl_ppo.get_reward = autocast(trl_ppo.get_reward)
    gc_seconds: list[float] = []

    class TimedGC:
        def __getattr__(self, name):
            return getattr(gc, name)

        @staticmethod
        def collect(*a, **k):
            t0 = time.perf_counter()
            try:
                return gc.collect(*a, **k)
            finally:
                gc_seconds.append(time.perf_counter() - t0)

    trl_ppo.gc = TimedGC()

    memory = wl.GpuMemory()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.update_s: list[float] = []
            self.logs: list[dict] = []
            self.last = None

        def on_train_begin(self, a, state, control, **kw):
            memory.reset()
            self.last = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            sync()
            now = time.perf_counter()
            total = now - self.last
            gen = marks["gen_end"] - marks["gen_start"]
            score = marks["opt_start"] - marks["gen_end"]
            opt = now - marks["opt_start"]
            for key, v in zip(phases, (gen, score, opt, total - gen - score - opt)):
                phases[key].append(v)
            self.update_s.append(total)
            marks.clear()
            memory.mark()
            self.last = now

        def on_log(self, a, state, control, logs=None, **kw):
            if logs:
                self.logs.append(dict(logs))

    timer = StepTimer()
    with contextlib.redirect_stdout(sys.stderr):
        trainer = PPOTrainer(
            args=config,
            processing_class=tok,
            model=policy,
            ref_model=reference,
            reward_model=reward,
            value_model=value,
            train_dataset=dataset,
            callbacks=[timer],
        )
        trl_mixed_precision = str(trainer.accelerator.mixed_precision)
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        optimizer = f"{type(opt).__name__}(fused={opt.defaults.get('fused')}, foreach={opt.defaults.get('foreach')})"
        t_train = time.perf_counter()
        trainer.train()
        t_end = time.perf_counter()
    shutil.rmtree(out_dir, ignore_errors=True)
    if len(timer.update_s) != args.updates:
        raise RuntimeError(f"timed {len(timer.update_s)} updates, expected {args.updates}")

    last = timer.logs[-1] if timer.logs else {}
    result = {
        "bench": "trl_rollout_bf16" if args.rollout_autocast else "trl",
        **wl.environment(),
        "config": vars(args),
        **wl.timing_fields(timer.update_s, args),
        "phase_median_s": {k: round(wl.median_after_first(v), 4) for k, v in phases.items()},
        "gc_collect_s_per_update": round(sum(gc_seconds) / args.updates, 4),
        "optimizer_steps_per_update": args.ppo_epochs * args.mini_batches,
        "params_trainable": wl.n_params(policy) + wl.n_params(value),
        "params": n_total,
        "params_matmul": n_matmul,
        "prompt_mean_tokens": round(wl.prompt_mean_length(prompt_ids), 2),
        "flops_per_update": wl.update_flops(args, n_matmul["policy"], n_matmul["value"], n_matmul["reward"],
                                            wl.prompt_mean_length(prompt_ids)),
        "precision": args.precision,
        "trl_mixed_precision": trl_mixed_precision,
        "rollout_autocast": args.rollout_autocast,
        "optimizer": optimizer,
        **memory.fields(),
        "setup_s": round(t_train - t_start, 3),
        "train_wall_s": round(t_end - t_train, 3),
        "peak_rss_mb": round(wl.peak_rss_mb(), 1),
        "final_metrics": {k: last.get(k) for k in ("objective/scores", "objective/kl", "loss/policy_avg",
                                                   "loss/value_avg", "val/ratio")},
    }
    wl.emit(result)


if __name__ == "__main__":
    main()
