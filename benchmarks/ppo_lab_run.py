#!/usr/bin/env python3
"""`ppo_lab.PPOTrainer` on the benchmark's workload, with a separate or a shared critic.

The policy and the tokenizer are built in-process (workload.py) and passed to the trainer; the
value model (a 1-label GPT2ForSequenceClassification) is saved to a temporary folder and given
as `critic_model`, so ppo_lab's `load_critic` reuses its classifier head; the reward model is
saved the same way and given as `reward`, so the reward is ppo_lab's own
`SequenceClassifierReward` (decode, re-tokenize, forward), the path a real reward model takes.
With `--critic shared` there is no value model: ppo_lab puts a value head on the policy.
`--algorithm grpo` runs the GRPO preset's algorithm (`ppo_lab/presets/grpo.yaml`: no critic,
group-normalised advantages over `--group` responses per prompt, the k3 KL in the loss at 0.04,
no whitening, seq-mean-token-mean) on the same models; `--batch` counts responses, so
`--batch / --group` prompts per update. `--decode` is `sampling.decode` (dynamic, static,
cuda_graph or auto); the JSON line says which decoder ran and whether a CUDA graph was kept.
`--sharding fsdp2` is `memory.sharding` (in one process a world of one: FSDP2's wrapping,
gathering and mixed precision without the split) and `--frozen-weights` is
`memory.frozen_weights`; the JSON line has the first iteration's KL (`first_kl`).

Dropout is switched off in the policy before it is passed in, as TRL does to its models and as
ppo_lab's own `load_policy` does (`--keep-dropout` leaves it on). Responses have a fixed length
(no stop token) through `sampling.ignore_eos` unless `--ignore-eos off`, and the JSON line says
which way the run went.

Per-update wall time is the interval between the ends of successive `PPOTrainer.iterate` calls
inside `train()` (the first one from its start), so it includes ppo_lab's per-iteration
logging; the phases come from ppo_lab's own metrics `time/rollout` and `time/update`. Prints one
JSON line on stdout.

On a GPU (`--device cuda`, used by gpu.py) ppo_lab takes the GPU through accelerate by itself;
`--precision bf16` is `memory.precision = "bf16"` (autocast, fp32 master weights and AdamW
state). The JSON line then also has the per-update peak GPU memory and the model FLOPs of an
update (workload.update_flops). `--profile FILE` runs one more update after the timed ones
under torch.profiler (not counted in the timings) and writes its operator tables to FILE.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import workload as wl  # sets the offline environment before transformers is imported

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    wl.add_workload_args(p)
    p.add_argument("--critic", choices=["separate", "shared"], default="separate")
    p.add_argument("--algorithm", choices=["ppo", "grpo"], default="ppo", help="grpo: the GRPO preset's algorithm, no critic")
    p.add_argument("--group", type=int, default=8, help="responses per prompt with --algorithm grpo")
    p.add_argument("--decode", choices=["dynamic", "static", "cuda_graph", "auto"], default="dynamic", help="sampling.decode")
    p.add_argument("--ignore-eos", choices=["auto", "on", "off"], default="auto",
                   help="fixed-length responses through sampling.ignore_eos (auto and on: fixed length; off: stop at EOS)")
    p.add_argument("--sharding", choices=["none", "fsdp2"], default="none", help="memory.sharding (fsdp2 in one process: a world of one)")
    p.add_argument("--frozen-weights", choices=["auto", "fp32", "bf16"], default="auto", help="memory.frozen_weights")
    p.add_argument("--keep-dropout", action="store_true", help="pass the policy with GPT-2's default dropout left on")
    p.add_argument("--profile", metavar="FILE", help="profile one extra update (after the timed ones) and write "
                                                     "torch.profiler's top operators by device and CPU time to FILE")
    p.add_argument("--profile-rows", type=int, default=40, help="rows per table of --profile")
    return p.parse_args(argv)


def write_profile(prof, path: str, rows: int, header: str) -> None:
    """torch.profiler's key averages of one update: by self device time, total device time, CPU time."""
    averages = prof.key_averages()
    keys = []
    sample = next(iter(averages), None)
    for key in ("self_device_time_total", "device_time_total", "self_cuda_time_total", "cuda_time_total"):
        if sample is not None and hasattr(sample, key):
            keys.append(key)
    if torch.cuda.is_available():
        sorts = [k for k in ("self_device_time_total", "device_time_total") if k in keys] or \
                [k for k in ("self_cuda_time_total", "cuda_time_total") if k in keys]
    else:
        sorts = []
    sorts += ["self_cpu_time_total", "cpu_time_total"]
    with open(path, "w") as fh:
        fh.write(header + "\n\n")
        for key in sorts:
            fh.write(f"===== top {rows} operators by {key} =====\n")
            fh.write(averages.table(sort_by=key, row_limit=rows, max_name_column_width=70) + "\n\n")


def source_of(module) -> dict:
    """Where the imported ppo_lab lives, and its git commit (with a '+dirty' mark) when it has one."""
    folder = Path(module.__file__).resolve().parent.parent
    info = {"path": str(folder)}
    try:
        def git(*cmd):
            return subprocess.run(["git", "-C", str(folder), *cmd], capture_output=True, text=True, check=True).stdout.strip()

        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "ppo_lab")
        info["commit"] = commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def main(argv=None):
    args = parse_args(argv)
    wl.setup_process(args)
    t_start = time.perf_counter()

    import ppo_lab
    from ppo_lab import PPOConfig, PPOTrainer

    tok, words = wl.make_tokenizer(args.vocab, args.seed)
    texts = wl.make_prompt_texts(words, args.n_prompts, args.prompt_min, args.prompt_max, args.seed)
    prompt_ids = wl.make_prompt_ids(tok, texts)  # checks one word = one token
    policy = wl.make_policy(tok, args)
    if not args.keep_dropout:
        wl.no_dropout(policy)

    tmp = Path(tempfile.mkdtemp(prefix="bench_ppo_lab_"))
    ignore_eos = args.ignore_eos != "off"
    # TRL has no early stop: every update runs all its epochs
    extra = {"sampling.ignore_eos": ignore_eos, "optim.early_stop_kl": None, "memory.precision": args.precision}
    reward_dir = tmp / "reward"
    reward_model = wl.make_reward_model(tok, args)
    n_matmul = {"policy": wl.matmul_params(policy), "reward": wl.matmul_params(reward_model)}
    n_total = {"policy": wl.n_params(policy), "reward": wl.n_params(reward_model)}
    reward_model.save_pretrained(reward_dir)
    tok.save_pretrained(reward_dir)
    del reward_model
    if args.critic == "separate" and args.algorithm == "ppo":
        critic_dir = tmp / "value"
        value_model = wl.make_value_model(tok, args)
        n_matmul["value"], n_total["value"] = wl.matmul_params(value_model), wl.n_params(value_model)
        value_model.save_pretrained(critic_dir)
        tok.save_pretrained(critic_dir)
        del value_model
        extra["critic.model"] = str(critic_dir)

    if args.algorithm == "grpo":  # ppo_lab/presets/grpo.yaml's algorithm
        extra.update({
            "critic.design": "none", "advantage.estimator": "grpo", "sampling.responses_per_prompt": args.group,
            "advantage.whiten": False, "loss.aggregation": "seq-mean-token-mean", "kl.placement": "loss",
            "kl.estimator": "k3", "loss.clip_eps": 0.2,
        })
    extra.update({"sampling.decode": args.decode, "memory.sharding": args.sharding, "memory.frozen_weights": args.frozen_weights})
    config = PPOConfig(**{"critic.design": args.critic, **extra}, **{ "reward.source": str(reward_dir), "batch.rollout": args.batch,
            "batch.minibatch": args.batch // args.mini_batches, "batch.epochs": args.ppo_epochs,
            "sampling.max_new_tokens": args.response_length, "optim.lr": args.lr,
            "sampling.temperature": args.temperature, "kl.coef": args.kl_coef,
            "run.iterations": args.updates + (1 if args.profile else 0), "run.eval_interval": 0,
            "run.progress_bar": False, "run.seed": args.seed, "run.output_dir": str(tmp / "run"),
        })
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    trainer = PPOTrainer(config, policy=policy, tokenizer=tok, train_prompts=texts)
    # the sampling loop's own time, and the decoder it ran with (trainer.generate is sampling.generate)
    import ppo_lab.decoding
    import ppo_lab.trainer

    sampling_s: list[float] = []
    graph_kept: list[bool] = []  # per call of generate with a graph decoder: was its graph checked and kept?
    decoder: list = []  # the current call's decoder only (each holds its KV cache and graph)
    real_generate, real_make = ppo_lab.trainer.generate, ppo_lab.sampling.make_decoder

    def timed_generate(*a, **k):
        sync()
        t0 = time.perf_counter()
        out = real_generate(*a, **k)
        sync()
        sampling_s.append(time.perf_counter() - t0)
        made = decoder.pop()
        if isinstance(made, ppo_lab.decoding.GraphedDecoder):
            graph_kept.append(made.checked and made.replay is not False)
        return out

    ppo_lab.trainer.generate = timed_generate
    ppo_lab.sampling.make_decoder = lambda *a, **k: decoder.append(real_make(*a, **k)) or decoder[-1]
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    optimizer = f"{type(opt).__name__}(fused={opt.defaults.get('fused')}, foreach={opt.defaults.get('foreach')})"

    ends: list[float] = []
    starts: list[float] = []
    real_step = trainer.iterate
    memory = wl.GpuMemory()
    profiled: dict = {}

    def timed_step():
        if args.profile and len(ends) == args.updates:  # the extra update, after the timed ones
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            sync()
            try:
                prof = profile(activities=activities)
                prof.start()
            except Exception as exc:  # no profiler here (CUPTI, ...): the timings still come back
                profiled["profile_error"] = repr(exc)
                return real_step()
            t0 = time.perf_counter()
            try:
                out = real_step()
                sync()
            finally:
                prof.stop()
            profiled["update_s_under_profiler"] = round(time.perf_counter() - t0, 3)
            try:
                header = (f"ppo_lab {args.critic} critic, one PPO update under torch.profiler "
                          f"({profiled['update_s_under_profiler']} s with the profiler on): {vars(args)}")
                write_profile(prof, args.profile, args.profile_rows, header)
                profiled["profile_file"] = args.profile
            except Exception as exc:  # the timings must come back even if the table fails
                profiled["profile_error"] = repr(exc)
            return out
        starts.append(time.perf_counter())
        out = real_step()
        sync()
        ends.append(time.perf_counter())
        memory.mark()
        return out

    trainer.iterate = timed_step
    memory.reset()
    t_train = time.perf_counter()
    history = trainer.train()
    t_end = time.perf_counter()
    shutil.rmtree(tmp, ignore_errors=True)
    if len(history) != args.updates + (1 if args.profile else 0):
        raise RuntimeError(f"ran {len(history)} iterations, expected {args.updates}")
    history = history[: args.updates]

    update_s = [ends[0] - starts[0]] + [b - a for a, b in zip(ends, ends[1:])]
    rollout = [h["time/rollout"] for h in history]
    update = [h["time/update"] for h in history]
    other = [u - r - p for u, r, p in zip(update_s, rollout, update)]
    last = history[-1]
    result = {
        "bench": f"ppo_lab_{args.critic}" if args.algorithm == "ppo" else "ppo_lab_grpo",
        **wl.environment(),
        "config": vars(args),
        "ppo_lab": source_of(ppo_lab),
        "ignore_eos": ignore_eos,
        **wl.timing_fields(update_s, args),
        "phase_median_s": {
            "sampling": round(wl.median_after_first(sampling_s[: args.updates]), 4),
            "rollout": round(wl.median_after_first(rollout), 4),
            "update": round(wl.median_after_first(update), 4),
            "other": round(wl.median_after_first(other), 4),
        },
        "response_length_mean": round(sum(h["response/length_mean"] for h in history) / len(history), 3),
        "optimizer_steps_per_update": args.ppo_epochs * args.mini_batches,
        "params": n_total,
        "params_matmul": n_matmul,
        "prompt_mean_tokens": round(wl.prompt_mean_length(prompt_ids), 2),
        "flops_per_update": wl.update_flops(args, n_matmul["policy"], n_matmul.get("value", 0), n_matmul["reward"],
                                            wl.prompt_mean_length(prompt_ids)),
        "precision": args.precision,
        "old_logprobs_from": trainer.sampler.old_logprobs_from,
        "algorithm": args.algorithm,
        "decode": trainer.sampling.decode,
        "sharding": args.sharding,
        "frozen_weights": args.frozen_weights,
        "first_kl": history[0]["objective/kl"],  # exactly 0 when the reference computes as the policy does
        "cuda_graph_kept": f"{sum(graph_kept)} of {len(graph_kept)} rollouts" if graph_kept else None,
        "cuda_allocator": {k: os.environ[k] for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if k in os.environ}
        or config.memory.cuda_allocator,
        "optimizer": optimizer,
        **memory.fields(),
        **profiled,
        "setup_s": round(t_train - t_start, 3),
        "train_wall_s": round(t_end - t_train, 3),
        "peak_rss_mb": round(wl.peak_rss_mb(), 1),
        "final_metrics": {k: last.get(k) for k in ("reward/score_mean", "objective/kl", "loss/policy", "loss/value",
                                                   "reward/ended_frac")},
    }
    wl.emit(result)


if __name__ == "__main__":
    main()
