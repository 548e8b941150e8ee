#!/usr/bin/env python3
"""`ppo_lab.PPOTrainer` on the benchmark's workload, with a separate or a shared critic.

The policy and the tokenizer are built in-process (workload.py) and passed to the trainer; the
value model (a 1-label GPT2ForSequenceClassification) is saved to a temporary folder and given
as `critic_model`, so ppo_lab's `load_critic` reuses its classifier head; the reward model is
saved the same way and given as `reward`, so the reward is ppo_lab's own
`SequenceClassifierReward` (decode, re-tokenize, forward), the path a real reward model takes.
With `--critic shared` there is no value model: ppo_lab puts a value head on the policy.

Dropout is switched off in the policy before it is passed in, as TRL does to its models and as
ppo_lab's own `load_policy` does (`--keep-dropout` leaves it on). Responses have a fixed length
(no stop token) when ppo_lab's config has `ignore_eos`; `--ignore-eos auto` (the default) turns
it on whenever the field exists, and the JSON line says which way the run went.

Per-update wall time is the interval between the ends of successive `PPOTrainer.step` calls
inside `train()` (the first one from its start), so it includes ppo_lab's per-iteration
logging; the phases come from ppo_lab's own metrics `time/rollout` and `time/update`. Prints one
JSON line on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import workload as wl  # sets the offline environment before transformers is imported


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    wl.add_workload_args(p)
    p.add_argument("--critic", choices=["separate", "shared"], default="separate")
    p.add_argument("--ignore-eos", choices=["auto", "on", "off"], default="auto",
                   help="fixed-length responses through PPOConfig.ignore_eos (auto: on if the field exists)")
    p.add_argument("--keep-dropout", action="store_true", help="pass the policy with GPT-2's default dropout left on")
    return p.parse_args(argv)


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
    wl.make_prompt_ids(tok, texts)  # checks one word = one token
    policy = wl.make_policy(tok, args)
    if not args.keep_dropout:
        wl.no_dropout(policy)

    tmp = Path(tempfile.mkdtemp(prefix="bench_ppo_lab_"))
    fields = {f.name for f in dataclasses.fields(PPOConfig)}
    if args.ignore_eos == "on" and "ignore_eos" not in fields:
        raise SystemExit("this ppo_lab's PPOConfig has no ignore_eos field")
    ignore_eos = "ignore_eos" in fields and args.ignore_eos != "off"
    extra = {"ignore_eos": ignore_eos} if "ignore_eos" in fields else {}
    if "target_kl" in fields:  # TRL has no early stop: every update runs all its epochs
        extra["target_kl"] = None
    reward_dir = tmp / "reward"
    wl.make_reward_model(tok, args).save_pretrained(reward_dir)
    tok.save_pretrained(reward_dir)
    if args.critic == "separate":
        critic_dir = tmp / "value"
        wl.make_value_model(tok, args).save_pretrained(critic_dir)
        tok.save_pretrained(critic_dir)
        extra["critic_model"] = str(critic_dir)

    config = PPOConfig(
        critic=args.critic,
        reward=str(reward_dir),
        rollout_batch_size=args.batch,
        minibatch_size=args.batch // args.mini_batches,
        ppo_epochs=args.ppo_epochs,
        max_new_tokens=args.response_length,
        learning_rate=args.lr,
        temperature=args.temperature,
        kl_coef=args.kl_coef,
        total_iterations=args.updates,
        eval_interval=0,
        progress_bar=False,
        seed=args.seed,
        output_dir=str(tmp / "run"),
        **extra,
    )
    trainer = PPOTrainer(config, policy=policy, tokenizer=tok, train_prompts=texts)

    ends: list[float] = []
    starts: list[float] = []
    real_step = trainer.step

    def timed_step():
        starts.append(time.perf_counter())
        out = real_step()
        ends.append(time.perf_counter())
        return out

    trainer.step = timed_step
    t_train = time.perf_counter()
    history = trainer.train()
    t_end = time.perf_counter()
    shutil.rmtree(tmp, ignore_errors=True)
    if len(history) != args.updates:
        raise RuntimeError(f"ran {len(history)} iterations, expected {args.updates}")

    update_s = [ends[0] - starts[0]] + [b - a for a, b in zip(ends, ends[1:])]
    rollout = [h["time/rollout"] for h in history]
    update = [h["time/update"] for h in history]
    other = [u - r - p for u, r, p in zip(update_s, rollout, update)]
    last = history[-1]
    result = {
        "bench": f"ppo_lab_{args.critic}",
        **wl.environment(),
        "config": vars(args),
        "ppo_lab": source_of(ppo_lab),
        "ignore_eos": ignore_eos,
        **wl.timing_fields(update_s, args),
        "phase_median_s": {
            "rollout": round(wl.median_after_first(rollout), 4),
            "update": round(wl.median_after_first(update), 4),
            "other": round(wl.median_after_first(other), 4),
        },
        "response_length_mean": round(sum(h["response/length_mean"] for h in history) / len(history), 3),
        "optimizer_steps_per_update": args.ppo_epochs * args.mini_batches,
        "setup_s": round(t_train - t_start, 3),
        "train_wall_s": round(t_end - t_train, 3),
        "peak_rss_mb": round(wl.peak_rss_mb(), 1),
        "final_metrics": {k: last.get(k) for k in ("reward/score_mean", "objective/kl", "loss/policy", "loss/value",
                                                   "reward/eos_fraction")},
    }
    wl.emit(result)


if __name__ == "__main__":
    main()
