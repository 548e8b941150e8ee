#!/usr/bin/env python3
"""The GPU benchmark: ppo_lab's PPOTrainer and TRL 1.12.0's PPOTrainer on one GPU workload.

    python benchmarks/gpu.py --out $OUT            # the full run, about 5 minutes on an H100
    python benchmarks/gpu.py --smoke               # tiny shapes, 2 updates: checks the plumbing (CPU or GPU)
    python benchmarks/gpu.py --profile --out $OUT  # and torch.profiler tables of one ppo_lab update

The runners are those of the CPU benchmark (`ppo_lab_run.py`, `trl_ppo.py`), one subprocess
each, one after the other, with `--device cuda --precision bf16` and the shape below. Each
prints one JSON line; this driver prints a markdown table and writes gpu-<stamp>.md, the raw
lines in gpu-<stamp>.jsonl and the runners' stderr in gpu-<stamp>.stderr.log to `--out`
(default benchmarks/results/), the table and the lines after every runner, so a run cut short
still leaves what it measured. ppo_lab is imported from this checkout (its root goes first on
PYTHONPATH); TRL and the rest from the interpreter's environment.

The workload (`--size gpu`): a random-init Llama (16 layers, d = 1024, 16 heads, MLP 2816,
vocabulary 32000 word-level tokens, untied embeddings: 271 M parameters) as policy and, with
the same weights, reference; two LlamaForSequenceClassification(num_labels=1) of the same shape
(238 M each) as the value and the reward model, their own seeds. One PPO update: 64 prompts of
64 to 128 tokens, 128 new tokens each with no stop token, temperature 0.7, then 4 epochs x 4
minibatches of 16 (16 AdamW steps, lr 1e-5) over policy + separate critic, KL coefficient
0.05. 5 updates per runner, the first a warm-up. Both trainers keep fp32 weights and fp32 AdamW
state and run the forwards in bf16 autocast (see trl_ppo.py for where TRL's autocast reaches).

Runners, in this order (those that would start after `--budget-s` are skipped, and each is
stopped at `--hard-limit-s` from the start):

  ppo_lab_separate   ppo_lab, separate critic (the comparison's subject)
  trl                TRL 1.12.0 PPOTrainer, bf16 through accelerate (training forward in bf16)
  trl_rollout_bf16   the same with its rollout forwards under bf16 autocast too (like ppo_lab)
  ppo_lab_shared     ppo_lab, value head on the policy (less work: one backbone, not two)

Reported per runner: seconds per update (median of the updates after the warm-up) and its
range, generated tokens per second (64 x 128 / s per update), the peak GPU memory of an update
(torch.cuda.max_memory_allocated and max_memory_reserved, reset at the start of each update,
the largest over the timed updates), and the model FLOPs utilisation:

  T   = batch x (mean prompt length + response length)     real tokens of an update
  N_x = matmul parameters of model x (all but the input embedding lookup table)
  FLOPs/update = 2 N_pol T                                  generation (prefill + decode)
               + 2 (N_pol + N_pol + N_val + N_rew) T        old log-probs, reference, value, reward
               + ppo_epochs x 6 (N_pol + N_val) T           training forward + backward
  MFU = FLOPs/update / (s/update) / peak, peak = 989 TFLOP/s (H100 SXM dense bf16)

The count is the same for every trainer on the same models (TRL reads its old log-probs from
the generation logits instead of a forward, so it is credited with one policy forward it skips,
under 4% of the total); the shared critic has N_val = 0. Attention's own FLOPs (~3% here) and the
padding of the prompts are left out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SIZES = {
    # ~271 M policy / reference, 238 M value / reward
    "gpu": dict(arch="llama", vocab=32000, n_layer=16, n_head=16, n_embd=1024, intermediate_size=2816,
                n_positions=256, n_prompts=512, prompt_min=64, prompt_max=128, batch=64, response_length=128,
                ppo_epochs=4, mini_batches=4, updates=5, threads=0),
    # a few seconds per runner on a CPU: checks that everything runs, measures nothing
    "smoke": dict(arch="llama", vocab=512, n_layer=2, n_head=4, n_embd=64, intermediate_size=0,
                  n_positions=64, n_prompts=32, prompt_min=8, prompt_max=16, batch=8, response_length=16,
                  ppo_epochs=2, mini_batches=2, updates=2, threads=1),
}

RUNNERS = {
    "ppo_lab_separate": ["ppo_lab_run.py", "--critic", "separate"],
    "trl": ["trl_ppo.py"],
    "trl_rollout_bf16": ["trl_ppo.py", "--rollout-autocast"],
    "ppo_lab_shared": ["ppo_lab_run.py", "--critic", "shared"],
}
LABELS = {
    "ppo_lab_separate": "ppo_lab, separate critic",
    "ppo_lab_shared": "ppo_lab, shared critic",
    "trl": "TRL 1.12.0 PPOTrainer",
    "trl_rollout_bf16": "TRL 1.12.0, rollout in bf16 autocast too",
}
# (label, numerator, denominator, quantity)
RATIOS = [
    ("time: ppo_lab separate / TRL", "ppo_lab_separate", "trl", "sec_per_update"),
    ("time: ppo_lab separate / TRL (rollout bf16)", "ppo_lab_separate", "trl_rollout_bf16", "sec_per_update"),
    ("time: ppo_lab shared / TRL", "ppo_lab_shared", "trl", "sec_per_update"),
    ("peak allocated: ppo_lab separate / TRL", "ppo_lab_separate", "trl", "gpu_peak_allocated_gib"),
    ("peak allocated: ppo_lab separate / TRL (rollout bf16)", "ppo_lab_separate", "trl_rollout_bf16", "gpu_peak_allocated_gib"),
    ("peak reserved: ppo_lab separate / TRL", "ppo_lab_separate", "trl", "gpu_peak_reserved_gib"),
]

# dense bf16 tensor-core peaks (TFLOP/s), by a piece of the device name
PEAKS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0),
         ("A100", 312.0), ("L40S", 362.0)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "results"), help="folder for gpu-<stamp>.md / .jsonl / .stderr.log")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and 2 updates (works on a CPU)")
    p.add_argument("--size", choices=sorted(SIZES), help="the workload's shape (default: gpu, or smoke with --smoke)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda when torch sees a GPU")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="auto: bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--only", default=",".join(RUNNERS), help="comma-separated subset, in order, of: " + ", ".join(RUNNERS))
    p.add_argument("--updates", type=int, help="PPO updates per runner, the first a warm-up (default: the size's)")
    p.add_argument("--profile", action="store_true",
                   help="ppo_lab separate also profiles one extra update: gpu-<stamp>.profile-ppo_lab.txt")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="start no runner later than this many seconds after the first one started")
    p.add_argument("--hard-limit-s", type=float, default=420.0,
                   help="stop any runner still going this many seconds after the start")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak for MFU (default: from its name, 989 for an H100 SXM)")
    p.add_argument("--python", default=sys.executable, help="interpreter of the runners (default: this one)")
    p.add_argument("--table-from", metavar="JSONL", help="only print the table of an earlier run's raw results")
    p.add_argument("extra", nargs="*", help="more workload flags for every runner, after --, e.g. -- --batch 32")
    return p.parse_args(argv)


def cuda_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def peak_for(gpu: str | None) -> tuple[float, str]:
    for piece, peak in PEAKS:
        if gpu and piece.lower() in gpu.lower():
            return peak, f"{piece} dense bf16"
    return 989.0, "H100 SXM dense bf16 (device not recognised)"


def flags(size: dict) -> list[str]:
    out = []
    for k, v in size.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def fmt(x, spec=".3f", none="n/a"):
    return none if x is None else format(x, spec)


def summarise(r: dict, peak_tflops: float | None) -> dict:
    """Derived numbers of one runner's JSON line."""
    flops = (r.get("flops_per_update") or {}).get("total")
    spu = r["sec_per_update"]
    s = {"tflop_per_update": flops / 1e12 if flops else None}
    s["tflops_achieved"] = flops / spu / 1e12 if flops else None
    s["mfu"] = s["tflops_achieved"] / peak_tflops if flops and peak_tflops and r.get("gpu") else None
    return s


def table(results: dict[str, dict], failed: dict[str, str], meta: dict) -> str:
    peak = meta.get("peak_tflops")
    any_r = next(iter(results.values()), None)
    out = []
    cfg = (any_r or {}).get("config") or meta.get("config", {})
    if any_r:
        p, m = any_r.get("params", {}), any_r.get("params_matmul", {})
        sizes = ", ".join(f"{k} {p[k] / 1e6:.1f} M ({m.get(k, 0) / 1e6:.1f} M matmul)" for k in ("policy", "value", "reward") if k in p)
        out.append(f"GPU: {any_r.get('gpu') or 'none (CPU run)'}; torch {any_r.get('torch')} (CUDA {any_r.get('cuda')}), "
                   f"transformers {any_r.get('transformers')}, accelerate {any_r.get('accelerate')}, trl {any_r.get('trl')}, "
                   f"Python {any_r.get('python')}, {any_r.get('nproc')} CPU cores.")
        out.append("")
        out.append(f"Workload: {cfg.get('arch')} {cfg.get('n_layer')} layers, d = {cfg.get('n_embd')}, {cfg.get('n_head')} heads, "
                   f"vocabulary {cfg.get('vocab')}, random init; params: {sizes}. One update: {cfg.get('batch')} prompts of "
                   f"{cfg.get('prompt_min')}-{cfg.get('prompt_max')} tokens (mean {any_r.get('prompt_mean_tokens')}), "
                   f"{cfg.get('response_length')} new tokens (no stop token), {cfg.get('ppo_epochs')} PPO epochs x "
                   f"{cfg.get('mini_batches')} minibatches; precision {cfg.get('precision')} (fp32 master weights); "
                   f"{cfg.get('updates')} updates per runner, the first a warm-up, median of the rest.")
        out.append("")
    out.append("| runner | s / update | min - max | tokens / s | TFLOP / update | TFLOP/s | MFU | peak alloc (GiB) | "
               "peak reserved (GiB) | phases (s, median) | setup (s) |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for name, r in results.items():
        s = summarise(r, peak)
        phases = ", ".join(f"{k} {v:.3f}" for k, v in (r.get("phase_median_s") or {}).items())
        out.append(f"| {LABELS.get(name, name)} | {r['sec_per_update']:.3f} | {r['sec_per_update_min']:.3f} - "
                   f"{r['sec_per_update_max']:.3f} | {r['tokens_per_s']:.0f} | {fmt(s['tflop_per_update'], '.1f')} | "
                   f"{fmt(s['tflops_achieved'], '.1f')} | {fmt(s['mfu'] and 100 * s['mfu'], '.1f')}{'%' if s['mfu'] else ''} | "
                   f"{fmt(r.get('gpu_peak_allocated_gib'), '.2f')} | {fmt(r.get('gpu_peak_reserved_gib'), '.2f')} | {phases} | "
                   f"{r.get('setup_s', 0):.1f} |")
    for name, why in failed.items():
        out.append(f"| {LABELS.get(name, name)} | {why} | | | | | | | | | |")
    rows = []
    for label, a, b, q in RATIOS:
        ra, rb = results.get(a), results.get(b)
        if ra and rb and ra.get(q) and rb.get(q):
            rows.append(f"| {label} | {ra[q] / rb[q]:.3f} |")
    if rows:
        out += ["", "| ratio (below 1: ppo_lab smaller / faster) | value |", "|---|---:|", *rows]
    out.append("")
    if peak:
        out.append(f"MFU = FLOPs/update / (s/update) / {peak:.0f} TFLOP/s ({meta.get('peak_note')}); FLOPs/update = "
                   "2 N_pol T (generation) + 2 (2 N_pol + N_val + N_rew) T (old log-probs, reference, value, reward) + "
                   "epochs x 6 (N_pol + N_val) T (training), T = batch x (mean prompt + response length), "
                   "N = matmul parameters (benchmarks/gpu.py).")
    notes = []
    for name, r in results.items():
        extra = []
        if name.startswith("ppo_lab"):
            extra.append(f"old log-probs from {r.get('old_logprobs_from')}, {r.get('optimizer')}, mean response length {r.get('response_length_mean')}")
            if r.get("profile_file"):
                extra.append(f"profile in {Path(r['profile_file']).name} ({r.get('update_s_under_profiler')} s under the profiler)")
            if r.get("profile_error"):
                extra.append(f"profile failed: {r['profile_error']}")
            src = r.get("ppo_lab") or {}
            extra.append(f"ppo_lab from {src.get('path')} {src.get('commit', '')}".rstrip())
        else:
            extra.append(f"accelerator mixed precision {r.get('trl_mixed_precision')}, rollout autocast {r.get('rollout_autocast')}, "
                         f"{r.get('optimizer')}, gc.collect {r.get('gc_collect_s_per_update')} s/update")
        extra.append(f"first update {r.get('first_update_s')} s, peak allocated in it {r.get('gpu_peak_allocated_first_update_gib')} GiB")
        notes.append(f"{LABELS.get(name, name)}: " + "; ".join(extra))
    out += [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def run_one(name, cmd, env, log, timeout):
    log.write(f"===== {name}: {' '.join(cmd)}\n")
    log.flush()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        log.write(f"\n===== {name}: stopped after {time.perf_counter() - t0:.0f} s (limit {timeout:.0f} s)\n")
        log.flush()
        return None, f"stopped at the time limit ({timeout:.0f} s)", (exc.stdout or "")
    log.write(f"\n===== {name}: exit {proc.returncode}, {time.perf_counter() - t0:.1f} s\n")
    log.flush()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None, f"failed (exit {proc.returncode}, see the stderr log)", proc.stdout
    return json.loads(lines[-1]), None, proc.stdout


def main(argv=None):
    args = parse_args(argv)
    if args.table_from:
        results = {}
        for line in Path(args.table_from).read_text().splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                results[r["bench"]] = r
        gpu = next(iter(results.values()), {}).get("gpu")
        peak, note = (args.peak_tflops, "given") if args.peak_tflops else peak_for(gpu)
        print(table(results, {}, {"peak_tflops": peak if gpu else None, "peak_note": note}), end="")
        return
    device = args.device if args.device != "auto" else ("cuda" if cuda_visible() else "cpu")
    precision = args.precision if args.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
    size = dict(SIZES[args.size or ("smoke" if args.smoke else "gpu")])
    if args.updates is not None:
        size["updates"] = args.updates
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RUNNERS))
    if unknown:
        raise SystemExit(f"unknown runner(s) {unknown}; choose from {list(RUNNERS)}")
    if precision != "bf16" and "trl_rollout_bf16" in names:
        names.remove("trl_rollout_bf16")  # (it is the bf16 variant)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    raw_path, table_path, log_path = out / f"gpu-{stamp}.jsonl", out / f"gpu-{stamp}.md", out / f"gpu-{stamp}.stderr.log"
    profile_path = out / f"gpu-{stamp}.profile-ppo_lab.txt"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRL_EXPERIMENTAL_SILENCE="1",
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    common = flags(size) + ["--device", device, "--precision", precision] + list(args.extra)
    print(f"gpu.py: device {device}, precision {precision}, runners {', '.join(names)}; writing {out}/gpu-{stamp}.*",
          file=sys.stderr, flush=True)

    results: dict[str, dict] = {}
    failed: dict[str, str] = {}
    meta: dict = {"config": {**size, "precision": precision}}
    t_start = time.perf_counter()
    with open(raw_path, "w") as raw, open(log_path, "w") as log:
        for name in names:
            elapsed = time.perf_counter() - t_start
            if elapsed > args.budget_s:
                failed[name] = f"skipped (time budget: {elapsed:.0f} s > {args.budget_s:.0f} s)"
                print(f"{name}: {failed[name]}", file=sys.stderr, flush=True)
                continue
            cmd = [args.python, str(HERE / RUNNERS[name][0]), *RUNNERS[name][1:], *common]
            if args.profile and name == "ppo_lab_separate":
                cmd += ["--profile", str(profile_path)]
            t0 = time.perf_counter()
            r, why, stdout = run_one(name, cmd, env, log, max(10.0, args.hard_limit_s - elapsed))
            if r is None:
                failed[name] = why
                tail = "\n".join(log_path.read_text().splitlines()[-12:])
                print(f"{name}: {why}\n{tail}", file=sys.stderr, flush=True)
            else:
                r["bench"] = name
                r["runner_wall_s"] = round(time.perf_counter() - t0, 1)
                results[name] = r
                raw.write(json.dumps(r) + "\n")
                raw.flush()
                print(f"{name}: {r['sec_per_update']:.3f} s/update, {r['tokens_per_s']:.0f} tokens/s, "
                      f"peak allocated {r.get('gpu_peak_allocated_gib')} GiB, {r['runner_wall_s']} s in all",
                      file=sys.stderr, flush=True)
            gpu = next(iter(results.values()), {}).get("gpu")
            if gpu:
                meta["peak_tflops"], meta["peak_note"] = (args.peak_tflops, "given") if args.peak_tflops else peak_for(gpu)
            table_path.write_text(table(results, failed, meta))
    text = table(results, failed, meta)
    table_path.write_text(text)
    print()
    print(text)
    print(f"total {time.perf_counter() - t_start:.0f} s; raw results {raw_path}, table {table_path}, runner logs {log_path}"
          + (f", profile {profile_path}" if profile_path.exists() else ""), file=sys.stderr)
    if failed and not results:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
