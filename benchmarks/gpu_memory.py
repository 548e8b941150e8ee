#!/usr/bin/env python3
"""ppo_lab's peak GPU memory, measured and estimated, in four configurations of the GPU workload.

    python benchmarks/gpu_memory.py --out DIR           # the GPU workload (about 3 minutes on an H100)
    python benchmarks/gpu_memory.py --smoke --out DIR   # tiny shapes: checks the plumbing (CPU or GPU)

The workload and the trainer are those of `gpu.py`'s `ppo_lab_separate` runner (the same models,
prompts and PPOConfig, built by `workload.py` the way `ppo_lab_run.py` builds them: the policy
in-process, the value and the reward model saved to a temporary folder and given as
`critic_model` and `reward`), in bf16 on a GPU, for `--updates` (2) PPO updates, in these
configurations (the default runs a to d):

  a  base        the ppo_lab_separate configuration
  b  chunk1024   the same with logprob_chunk_size = 1024
  c  ckpt        the same with gradient_checkpointing = True
  d  ga4         the same with gradient_accumulation_steps = 4 (micro-batches of 4, not 16)
  e  fsdp2       the same with memory.sharding = fsdp2 in one process (a world of one; the estimate with sharding="fsdp2")
  f  qwen1.5b    gpu.py's "qwen1.5b" size (Qwen2.5-1.5B's shape, random init, 512-token prompts and responses) with
                 gradient checkpointing, log-probs in chunks of 1024 and batch.forward 16: the README table's scale

Each configuration runs in a subprocess of its own (a clean allocator, and an out-of-memory
error stops only that one). Per configuration, of the last update: the peak allocated GPU
memory (`perf/peak_memory_mb`, ppo_lab's own reading of `torch.cuda.max_memory_allocated`, reset
when its `step` starts), the peak reserved memory, the seconds of the update and its `sampler/kl`
(bf16 recomputes the old log-probs with a forward, so ppo_lab logs how far they are from the
sampler's). Next to it, `ppo_lab.memory.estimate_memory(config, policy, prompt_len=<longest
prompt>, response_len=<response length>, critic=<critic>, reward=<reward model>)`, its
per-component rows for both phases, and the ratio measured / estimated.

Writes gpu-memory-<stamp>.md and .jsonl to `--out` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CONFIGS = {
    "base": ("a", "ppo_lab_separate (gpu.py)", {}),
    "chunk1024": ("b", "memory.logprob_chunk = 1024", {"memory.logprob_chunk": 1024}),
    "ckpt": ("c", "memory.gradient_checkpointing = True", {"memory.gradient_checkpointing": True}),
    "ga4": ("d", "batch.accumulation_steps = 4", {"batch.accumulation_steps": 4}),
    "fsdp2": ("e", "memory.sharding = fsdp2 (a world of one)", {"memory.sharding": "fsdp2"}),
    # one iteration at the README table's scale: a Qwen2.5-1.5B-shaped policy, value and reward model (gpu.py's "qwen1.5b")
    "qwen1.5b": ("f", "Qwen2.5-1.5B shape, gradient checkpointing, logprob_chunk 1024, batch.forward 16",
                 {"memory.gradient_checkpointing": True, "memory.logprob_chunk": 1024, "batch.forward": 16}),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes (gpu.py's smoke size)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto", help="auto: bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--updates", type=int, default=2, help="PPO updates per configuration (the last one is reported)")
    p.add_argument("--only", default="base,chunk1024,ckpt,ga4", help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--timeout-s", type=float, default=240.0, help="stop one configuration after this many seconds")
    p.add_argument("--budget-s", type=float, default=330.0, help="start no configuration later than this after the first")
    p.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- one configuration, in its own process ---------------------------------------------------
def worker(args) -> None:
    sys.path.insert(0, str(HERE))
    import workload as wl  # sets the offline environment before transformers is imported
    from gpu import SIZES

    import torch

    size = dict(SIZES["smoke" if args.smoke else ("qwen1.5b" if args.worker == "qwen1.5b" else "gpu")], updates=args.updates)
    wp = argparse.ArgumentParser()
    wl.add_workload_args(wp)
    flags = []
    for k, v in size.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    w = wp.parse_args(flags + ["--device", args.device, "--precision", args.precision])
    wl.setup_process(w)

    from ppo_lab import PPOConfig, PPOTrainer
    from ppo_lab.memory import ModelShape, estimate_memory

    t_start = time.perf_counter()
    tok, words = wl.make_tokenizer(w.vocab, w.seed)
    texts = wl.make_prompt_texts(words, w.n_prompts, w.prompt_min, w.prompt_max, w.seed)
    prompt_ids = wl.make_prompt_ids(tok, texts)
    policy = wl.no_dropout(wl.make_policy(tok, w))
    policy_shape = ModelShape.of(policy)

    tmp = Path(tempfile.mkdtemp(prefix="bench_gpu_memory_"))
    reward_model = wl.make_reward_model(tok, w)
    reward_shape = ModelShape.of(reward_model)
    reward_model.save_pretrained(tmp / "reward")
    tok.save_pretrained(tmp / "reward")
    del reward_model
    value_model = wl.make_value_model(tok, w)
    value_model.save_pretrained(tmp / "value")
    tok.save_pretrained(tmp / "value")
    del value_model

    extra = {"sampling.ignore_eos": True, "optim.early_stop_kl": None, "memory.precision": w.precision}  # as ppo_lab_run.py does
    letter, _, overrides = CONFIGS[args.worker]
    config = PPOConfig(**extra, **overrides, **{
            "critic.design": "separate", "critic.model": str(tmp / "value"),
            "reward.source": str(tmp / "reward"), "batch.rollout": w.batch,
            "batch.minibatch": w.batch // w.mini_batches, "batch.epochs": w.ppo_epochs,
            "sampling.max_new_tokens": w.response_length, "optim.lr": w.lr,
            "sampling.temperature": w.temperature, "kl.coef": w.kl_coef, "run.iterations": args.updates,
            "run.eval_interval": 0, "run.progress_bar": False, "run.seed": w.seed,
            "run.output_dir": str(tmp / "run"),
        })
    trainer = PPOTrainer(config, policy=policy, tokenizer=tok, train_prompts=texts)
    critic = trainer.accelerator.unwrap_model(trainer.critic)
    critic_shape = ModelShape.from_config(critic.backbone.config, params=sum(p.numel() for p in critic.parameters()))
    prompt_len = max(len(p) for p in prompt_ids)
    est = estimate_memory(config, policy_shape, prompt_len=prompt_len, response_len=w.response_length,
                          critic=critic_shape, reward=reward_shape, sharding=config.memory.sharding)

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    steps: list[dict] = []
    real_step = trainer.iterate

    def timed_step():
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = real_step()
        sync()
        rec = {"s": time.perf_counter() - t0}
        if cuda:
            rec["max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
            rec["max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
        steps.append(rec)
        return out

    trainer.iterate = timed_step
    t_train = time.perf_counter()
    history = trainer.train()
    shutil.rmtree(tmp, ignore_errors=True)
    last, rec = history[-1], steps[-1]
    measured = last.get("perf/peak_memory_mb")
    result = {
        "config": args.worker, "letter": letter, "overrides": overrides,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
        "precision": w.precision, "workload": size, "prompt_len_max": prompt_len,
        "old_logprobs_from": trainer.sampler.old_logprobs_from,
        "updates": len(history), "sec_per_update": [round(s["s"], 3) for s in steps],
        "peak_memory_mb": [h.get("perf/peak_memory_mb") for h in history],
        "measured_peak_mib": measured if cuda else None,
        "max_allocated_mib": rec.get("max_allocated_mib"), "max_reserved_mib": rec.get("max_reserved_mib"),
        "sampler_kl": [h.get("sampler/kl") for h in history],
        "time_rollout_s": last.get("time/rollout"), "time_update_s": last.get("time/update"),
        "estimate_peak_mib": est.peak / 2**20, "estimate_peak_phase": est.peak_phase,
        "estimate_rows": [[k, round(r, 1), round(u, 1)] for k, r, u in est.rows()],
        "ratio_measured_over_estimate": (measured / (est.peak / 2**20)) if cuda and measured else None,
        "shapes": {k: dataclasses.asdict(v) for k, v in (("policy", policy_shape), ("critic", critic_shape), ("reward", reward_shape))},
        "setup_s": round(t_train - t_start, 1),
    }
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


# --- the driver ------------------------------------------------------------------------------
def fmt(x, spec=".0f"):
    return "n/a" if x is None else format(x, spec)


def table(results: list[dict], failed: dict[str, str]) -> str:
    out = []
    if results:
        r0 = results[0]
        wk = r0["workload"]
        out.append(f"Device: {r0['device']}; torch {r0['torch']}; precision {r0['precision']}; workload: {wk['arch']} "
                   f"{wk['n_layer']} layers, d = {wk['n_embd']}, vocabulary {wk['vocab']}; {wk['batch']} prompts "
                   f"(longest {r0['prompt_len_max']} tokens) x {wk['response_length']} new tokens, {wk['ppo_epochs']} epochs x "
                   f"{wk['mini_batches']} minibatches, separate critic; old log-probs from {r0['old_logprobs_from']}; "
                   f"{r0['updates']} updates, the last one reported.")
        out.append("")
    out.append("| config | change | s / update (last; all) | measured peak alloc (MiB) | peak reserved (MiB) | "
               "estimate (MiB, phase) | measured / estimate | sampler/kl (last) |")
    out.append("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        letter, change, _ = CONFIGS[r["config"]]
        kl = r["sampler_kl"][-1]
        out.append(f"| {letter} {r['config']} | {change} | {r['sec_per_update'][-1]:.2f}; {', '.join(f'{s:.2f}' for s in r['sec_per_update'])} | "
                   f"{fmt(r['measured_peak_mib'])} | {fmt(r['max_reserved_mib'])} | {r['estimate_peak_mib']:.0f} ({r['estimate_peak_phase']}) | "
                   f"{fmt(r['ratio_measured_over_estimate'], '.3f')} | {fmt(kl, '.2e')} |")
    for name, why in failed.items():
        out.append(f"| {CONFIGS[name][0]} {name} | {CONFIGS[name][1]} | {why} | | | | | |")
    for r in results:
        out += ["", f"Estimate rows, {CONFIGS[r['config']][0]} {r['config']} (MiB):", "",
                "| component | rollout | update |", "|---|---:|---:|"]
        out += [f"| {k} | {a:.1f} | {b:.1f} |" for k, a, b in r["estimate_rows"]]
    return "\n".join(out) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.device == "auto":
        try:
            import torch

            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        except Exception:
            args.device = "cpu"
    if args.precision == "auto":
        args.precision = "bf16" if args.device == "cuda" else "fp32"
    if args.worker:
        return worker(args)

    names = [n.strip() for n in args.only.split(",") if n.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    md, raw = out / f"gpu-memory-{stamp}.md", out / f"gpu-memory-{stamp}.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    results, failed = [], {}
    t_start = time.perf_counter()
    with open(raw, "w") as fh:
        for name in names:
            elapsed = time.perf_counter() - t_start
            if elapsed > args.budget_s:
                failed[name] = f"skipped (budget: {elapsed:.0f} s)"
                continue
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--device", args.device,
                   "--precision", args.precision, "--updates", str(args.updates)] + (["--smoke"] if args.smoke else [])
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      timeout=args.timeout_s)
            except subprocess.TimeoutExpired:
                failed[name] = f"stopped at {args.timeout_s:.0f} s"
                print(f"{name}: {failed[name]}", file=sys.stderr, flush=True)
                continue
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                failed[name] = f"failed (exit {proc.returncode})"
                print(f"{name}: {failed[name]}\n" + "\n".join(proc.stderr.splitlines()[-15:]), file=sys.stderr, flush=True)
                continue
            r = json.loads(lines[-1])
            r["wall_s"] = round(time.perf_counter() - t0, 1)
            results.append(r)
            fh.write(json.dumps(r) + "\n")
            fh.flush()
            print(f"{name}: {r['sec_per_update']} s/update, peak {fmt(r['measured_peak_mib'])} MiB (reserved "
                  f"{fmt(r['max_reserved_mib'])}), estimate {r['estimate_peak_mib']:.0f} MiB, sampler/kl {r['sampler_kl']}, "
                  f"{r['wall_s']} s in all", file=sys.stderr, flush=True)
            md.write_text(table(results, failed))
    text = table(results, failed)
    md.write_text(text)
    print(text)
    print(f"total {time.perf_counter() - t_start:.0f} s; {md}, {raw}", file=sys.stderr)
    if not results:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
