#!/usr/bin/env python3
"""The GPU benchmark: ppo_lab beside TRL 1.12.0's PPOTrainer and TRL's GRPOTrainer, on one GPU.

    python benchmarks/gpu.py --out $OUT            # every runner: over 10 minutes on an H100 (estimated)
    bash benchmarks/device_check.sh ppo|grpo       # the prepared GPU check, in two commands under 10 minutes each
    python benchmarks/gpu.py --smoke               # tiny shapes: checks the plumbing (CPU or GPU)
    python benchmarks/gpu.py --profile --out $OUT  # and torch.profiler tables of one ppo_lab update

The runners are those of the CPU benchmark (`ppo_lab_run.py`, `trl_ppo.py`) and `trl_grpo.py`,
one subprocess each, with `--device cuda --precision bf16` and the shape below. Each prints one
JSON line; this driver writes gpu-<stamp>.md (the table), the raw lines in gpu-<stamp>.jsonl and
the runners' stderr in gpu-<stamp>.stderr.log to `--out` (default benchmarks/results/), after
every runner, so a run cut short still leaves what it measured. ppo_lab is imported from this
checkout (its root goes first on PYTHONPATH); TRL and the rest from the interpreter's environment.

Runners are alternated: `--rounds` rounds (default 2), each running every runner once with
`--updates` updates (default 6, the first a warm-up), so each runner has rounds x (updates - 1)
timed updates (10) and a drift of the machine during the run falls on every runner alike. A
ratio between two runners is reported as the ratio of their medians over all timed updates,
with its range over the rounds (the ratio of each round's medians).

The workload (`--size gpu`): a random-init Llama (16 layers, d = 1024, 16 heads, MLP 2816,
vocabulary 32000 word-level tokens, untied embeddings: 271 M parameters) as policy and, with
the same weights, reference; two LlamaForSequenceClassification(num_labels=1) of the same shape
(238 M each) as the value and the reward model, their own seeds. One PPO update: 64 prompts of
64 to 128 tokens, 128 new tokens each with no stop token, temperature 0.7, then 4 epochs x 4
minibatches of 16 (16 AdamW steps, lr 1e-5) over policy + separate critic, KL coefficient
0.05. The GRPO runners use the GRPO preset's algorithm on the same policy and reward model: 8
prompts x 8 responses per update, 2 epochs x 2 minibatches of 32, no critic, the k3 KL in the
loss at 0.04. All keep fp32 weights and fp32 AdamW state and run the forwards in bf16 autocast
(see trl_ppo.py for where TRL's autocast reaches).

Runners (`--only` picks and orders them):

  ppo_lab_separate   ppo_lab, separate critic, sampling.decode = dynamic (the growing KV cache)
  ppo_lab_graph      the same with sampling.decode = cuda_graph (static cache, one graph replay per token)
  trl                TRL 1.12.0 PPOTrainer, bf16 through accelerate (training forward in bf16)
  ppo_lab_grpo       ppo_lab, the GRPO preset's algorithm, sampling.decode = auto
  trl_grpo           TRL 1.12.0 GRPOTrainer without vLLM (transformers' generate)
  trl_rollout_bf16   TRL's PPOTrainer with its rollout forwards under bf16 autocast too (like ppo_lab)
  ppo_lab_shared     ppo_lab, value head on the policy (less work: one backbone, not two)
  ppo_lab_fsdp2      ppo_lab_separate with memory.sharding = fsdp2 on a world of one (FSDP2's cost, no split)
  ppo_lab_frozen_fp32  ppo_lab_separate with memory.frozen_weights = fp32 (what the bf16 frozen weights save)

Reported per runner, reserved memory first (it is what runs out): the peak GPU memory of an
update (torch.cuda.max_memory_reserved and max_memory_allocated, reset at the start of each
update, the largest over the timed updates); seconds per update (median) and its range;
generated tokens per second; the sampling loop's seconds per update beside its bandwidth bound;
the update phase's MFU; and the end-to-end MFU:

  T   = batch x (mean prompt length + response length)     real tokens of an update
  N_x = matmul parameters of model x (all but the input embedding lookup table)
  FLOPs/update = 2 N_pol T                                  generation (prefill + decode)
               + 2 (N_pol + N_pol + N_val + N_rew) T        old log-probs, reference, value, reward
               + epochs x 6 (N_pol + N_val) T               training forward + backward
  MFU = FLOPs / seconds / peak, peak = the GPU's dense bf16 tensor-core FLOP/s (989 T for an H100 SXM)
  update MFU = epochs x 6 (N_pol + N_val) T / the update phase's seconds / peak
  sampling bound = (R x 2 N_pol + sum over the R steps of the KV cache read) bytes / HBM bandwidth:
      every decode step reads the policy's bf16 weights once and each row's cached keys and
      values (2 x layers x d x 2 bytes per cached token); R = new tokens per response

The count is the same for every trainer on the same models (TRL's PPO reads its old log-probs
from the generation logits instead of a forward, so it is credited with one policy forward it
skips, under 4% of the total); the shared critic and GRPO have N_val = 0. Attention's own FLOPs
(~3% here) and the padding of the prompts are left out.
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
                ppo_epochs=4, mini_batches=4, updates=6, threads=0),
    # Qwen2.5-1.5B's sizes (random init, its head untied: 1.78 B parameters; a word-level tokenizer of its
    # vocabulary size), 512-token prompts and responses: gpu_memory.py's check of the estimate at the README table's scale
    "qwen1.5b": dict(arch="llama", vocab=151936, n_layer=28, n_head=12, n_kv_head=2, n_embd=1536, intermediate_size=8960,
                     n_positions=1040, n_prompts=256, prompt_min=256, prompt_max=512, batch=64, response_length=512,
                     ppo_epochs=1, mini_batches=8, updates=1, threads=0),
    # a few seconds per runner on a CPU: checks that everything runs, measures nothing
    "smoke": dict(arch="llama", vocab=512, n_layer=2, n_head=4, n_embd=64, intermediate_size=0,
                  n_positions=64, n_prompts=32, prompt_min=8, prompt_max=16, batch=8, response_length=16,
                  ppo_epochs=2, mini_batches=2, updates=2, threads=1),
}

GRPO = ["--ppo-epochs", "2", "--mini-batches", "2", "--kl-coef", "0.04", "--group", "8"]  # ppo_lab/presets/grpo.yaml
RUNNERS = {
    "ppo_lab_separate": ["ppo_lab_run.py", "--critic", "separate", "--decode", "dynamic"],
    "ppo_lab_graph": ["ppo_lab_run.py", "--critic", "separate", "--decode", "cuda_graph"],
    "trl": ["trl_ppo.py"],
    "ppo_lab_grpo": ["ppo_lab_run.py", "--algorithm", "grpo", "--decode", "auto", *GRPO],
    "trl_grpo": ["trl_grpo.py", *GRPO],
    "trl_rollout_bf16": ["trl_ppo.py", "--rollout-autocast"],
    "ppo_lab_shared": ["ppo_lab_run.py", "--critic", "shared"],
    "ppo_lab_fsdp2": ["ppo_lab_run.py", "--critic", "separate", "--decode", "dynamic", "--sharding", "fsdp2"],
    "ppo_lab_frozen_fp32": ["ppo_lab_run.py", "--critic", "separate", "--decode", "dynamic", "--frozen-weights", "fp32"],
}
DEFAULT_RUNNERS = ["ppo_lab_separate", "ppo_lab_graph", "trl", "ppo_lab_grpo", "trl_grpo"]
LABELS = {
    "ppo_lab_separate": "ppo_lab, separate critic",
    "ppo_lab_graph": "ppo_lab, separate critic, CUDA-graph decode",
    "ppo_lab_grpo": "ppo_lab, GRPO preset",
    "trl_grpo": "TRL 1.12.0 GRPOTrainer (no vLLM)",
    "ppo_lab_shared": "ppo_lab, shared critic",
    "trl": "TRL 1.12.0 PPOTrainer",
    "trl_rollout_bf16": "TRL 1.12.0, rollout in bf16 autocast too",
    "ppo_lab_fsdp2": "ppo_lab, separate critic, FSDP2 on a world of one",
    "ppo_lab_frozen_fp32": "ppo_lab, separate critic, frozen weights in float32",
}
# (label, numerator, denominator, quantity)
RATIOS = [
    ("peak reserved: ppo_lab separate / TRL", "ppo_lab_separate", "trl", "gpu_peak_reserved_gib"),
    ("peak reserved: ppo_lab CUDA-graph decode / TRL", "ppo_lab_graph", "trl", "gpu_peak_reserved_gib"),
    ("peak reserved: ppo_lab GRPO / TRL GRPO", "ppo_lab_grpo", "trl_grpo", "gpu_peak_reserved_gib"),
    ("time: ppo_lab CUDA-graph decode / TRL", "ppo_lab_graph", "trl", "sec_per_update"),
    ("time: ppo_lab CUDA-graph decode / ppo_lab dynamic decode", "ppo_lab_graph", "ppo_lab_separate", "sec_per_update"),
    ("time: ppo_lab GRPO / TRL GRPO", "ppo_lab_grpo", "trl_grpo", "sec_per_update"),
    ("time: ppo_lab separate / TRL", "ppo_lab_separate", "trl", "sec_per_update"),
    ("time: ppo_lab separate / TRL (rollout bf16)", "ppo_lab_separate", "trl_rollout_bf16", "sec_per_update"),
    ("time: ppo_lab shared / TRL", "ppo_lab_shared", "trl", "sec_per_update"),
    ("peak allocated: ppo_lab separate / TRL", "ppo_lab_separate", "trl", "gpu_peak_allocated_gib"),
    ("peak allocated: ppo_lab separate / TRL (rollout bf16)", "ppo_lab_separate", "trl_rollout_bf16", "gpu_peak_allocated_gib"),
    ("peak reserved: ppo_lab FSDP2 world of one / unsharded", "ppo_lab_fsdp2", "ppo_lab_separate", "gpu_peak_reserved_gib"),
    ("peak allocated: ppo_lab FSDP2 world of one / unsharded", "ppo_lab_fsdp2", "ppo_lab_separate", "gpu_peak_allocated_gib"),
    ("time: ppo_lab FSDP2 world of one / unsharded", "ppo_lab_fsdp2", "ppo_lab_separate", "sec_per_update"),
    ("peak allocated: frozen weights in bf16 / in float32", "ppo_lab_separate", "ppo_lab_frozen_fp32", "gpu_peak_allocated_gib"),
]

# dense bf16 tensor-core peaks (TFLOP/s), by a piece of the device name
PEAKS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("GH200", 989.0), ("H200 NVL", 835.0), ("H200", 989.0),
         ("A100", 312.0), ("L40S", 362.0)]
# HBM bandwidth (bytes/s), by a piece of the device name (the vendors' data sheets)
BANDWIDTHS = [("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12), ("GH200", 4.0e12), ("H200 NVL", 4.8e12), ("H200", 4.8e12),
              ("A100", 2.0e12), ("L40S", 0.864e12)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "results"), help="folder for gpu-<stamp>.md / .jsonl / .stderr.log")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and 2 updates (works on a CPU)")
    p.add_argument("--size", choices=sorted(SIZES), help="the workload's shape (default: gpu, or smoke with --smoke)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda when torch sees a GPU")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="auto: bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--only", default=",".join(DEFAULT_RUNNERS), help="comma-separated subset, in order, of: " + ", ".join(RUNNERS))
    p.add_argument("--updates", type=int, help="updates per runner and round, the first a warm-up (default: the size's)")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every runner once, in order")
    p.add_argument("--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF for every runner (e.g. expandable_segments:True, to give TRL "
                                        "the allocator ppo_lab uses by default)")
    p.add_argument("--profile", action="store_true",
                   help="ppo_lab separate also profiles one extra update: gpu-<stamp>.profile-ppo_lab.txt")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="start no runner later than this many seconds after the first one started")
    p.add_argument("--hard-limit-s", type=float, default=570.0,
                   help="stop any runner still going this many seconds after the start")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak for MFU (default: from its name, 989 for an H100 SXM)")
    p.add_argument("--bandwidth", type=float, help="the GPU's HBM bandwidth in bytes/s for the sampling bound (default: from its name)")
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


def bandwidth_for(gpu: str | None) -> float | None:
    return next((bw for piece, bw in BANDWIDTHS if gpu and piece.lower() in gpu.lower()), None)


def flags(size: dict) -> list[str]:
    out = []
    for k, v in size.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def fmt(x, spec=".3f", none="n/a"):
    return none if x is None else format(x, spec)


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def merge_rounds(lines: list[dict]) -> dict:
    """One runner's JSON lines (one per round) as one result: the timed updates of every round
    (each round's first update is its warm-up), the largest memory peaks, the phases' medians."""
    r = dict(lines[0])
    timed = [u for line in lines for u in (line["update_s"][1:] or line["update_s"])]
    r["timed_update_s"] = timed
    r["rounds"] = len(lines)
    r["sec_per_update"] = round(median(timed), 4)
    r["sec_per_update_min"], r["sec_per_update_max"] = round(min(timed), 4), round(max(timed), 4)
    r["tokens_per_s"] = round(r["tokens_per_update"] / r["sec_per_update"], 1)
    r["round_sec_per_update"] = {line.get("round", i + 1): line["sec_per_update"] for i, line in enumerate(lines)}
    for key in ("gpu_peak_allocated_gib", "gpu_peak_reserved_gib"):
        if all(line.get(key) is not None for line in lines):
            r[key] = max(line[key] for line in lines)
            r[f"round_{key}"] = {line.get("round", i + 1): line[key] for i, line in enumerate(lines)}
    phases = [line.get("phase_median_s") or {} for line in lines]
    r["phase_median_s"] = {k: round(median([p[k] for p in phases if k in p]), 4) for k in phases[0]}
    r["setup_s"] = round(median([line.get("setup_s", 0) for line in lines]), 1)
    return r


def sampling_bound_s(r: dict, bandwidth: float | None) -> float | None:
    """Seconds the sampling loop needs at the HBM bandwidth: every decode step reads the policy's
    bf16 matmul weights once, and each row's cached keys and values."""
    cfg, m = r.get("config") or {}, r.get("params_matmul") or {}
    if not bandwidth or "policy" not in m or not cfg.get("n_layer"):
        return None
    steps, batch, prompt = cfg["response_length"], cfg["batch"], r.get("prompt_mean_tokens") or 0
    cached = batch * (steps * prompt + steps * (steps - 1) / 2)  # cached tokens read over all the steps
    kv_bytes = 2 * cfg["n_layer"] * cfg["n_embd"] * 2 * cached  # keys and values, bf16
    return (steps * 2 * m["policy"] + kv_bytes) / bandwidth


def summarise(r: dict, peak_tflops: float | None, bandwidth: float | None = None) -> dict:
    """Derived numbers of one runner's result."""
    flops = r.get("flops_per_update") or {}
    spu = r["sec_per_update"]
    on_gpu = bool(r.get("gpu"))
    s = {"tflop_per_update": flops["total"] / 1e12 if flops.get("total") else None}
    s["tflops_achieved"] = flops["total"] / spu / 1e12 if flops.get("total") else None
    s["mfu"] = s["tflops_achieved"] / peak_tflops if s["tflops_achieved"] and peak_tflops and on_gpu else None
    phases = r.get("phase_median_s") or {}
    update = phases.get("update", phases.get("optimise"))  # (TRL's PPO runner calls it optimise)
    s["update_s"] = update
    s["update_mfu"] = flops["train"] / update / 1e12 / peak_tflops if flops.get("train") and update and peak_tflops and on_gpu else None
    sampling = (r.get("phase_median_s") or {}).get("sampling") or (r.get("phase_median_s") or {}).get("generate")
    s["sampling_s"] = sampling
    s["sampling_bound_s"] = sampling_bound_s(r, bandwidth) if on_gpu else None
    s["bandwidth_frac"] = s["sampling_bound_s"] / sampling if s["sampling_bound_s"] and sampling else None
    return s


def pct(x):
    return f"{100 * x:.1f}%" if x is not None else "n/a"


def table(results: dict[str, dict], failed: dict[str, str], meta: dict) -> str:
    peak, bandwidth = meta.get("peak_tflops"), meta.get("bandwidth")
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
                   f"vocabulary {cfg.get('vocab')}, random init; params: {sizes}. One update: {cfg.get('batch')} responses to prompts of "
                   f"{cfg.get('prompt_min')}-{cfg.get('prompt_max')} tokens (mean {any_r.get('prompt_mean_tokens')}), "
                   f"{cfg.get('response_length')} new tokens (no stop token); PPO: {cfg.get('ppo_epochs')} epochs x "
                   f"{cfg.get('mini_batches')} minibatches; GRPO: the preset's 8 x 8 responses, 2 epochs x 2 minibatches; "
                   f"precision {cfg.get('precision')} (fp32 master weights); {meta.get('rounds', 1)} rounds of "
                   f"{cfg.get('updates')} updates per runner, runners alternated, each round's first update a warm-up; "
                   f"medians over the timed updates.")
        out.append("")
    out.append("| runner | peak reserved (GiB) | peak alloc (GiB) | s / update | min - max | timed | tokens / s | "
               "sampling s (bound, % of bandwidth) | update s (MFU) | end-to-end MFU | setup (s) |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        s = summarise(r, peak, bandwidth)
        update = s["update_s"]
        sampling = (f"{s['sampling_s']:.3f} ({fmt(s['sampling_bound_s'], '.3f')}, {pct(s['bandwidth_frac'])})"
                    if s["sampling_s"] is not None else "n/a")
        out.append(f"| {LABELS.get(name, name)} | {fmt(r.get('gpu_peak_reserved_gib'), '.2f')} | "
                   f"{fmt(r.get('gpu_peak_allocated_gib'), '.2f')} | {r['sec_per_update']:.3f} | {r['sec_per_update_min']:.3f} - "
                   f"{r['sec_per_update_max']:.3f} | {len(r.get('timed_update_s') or r.get('update_s', [])[1:])} | "
                   f"{r['tokens_per_s']:.0f} | {sampling} | {fmt(update, '.3f')} ({pct(s['update_mfu'])}) | {pct(s['mfu'])} | "
                   f"{r.get('setup_s', 0):.1f} |")
    for name, why in failed.items():
        out.append(f"| {LABELS.get(name, name)} | {why} | | | | | | | | | |")
    rows = []
    for label, a, b, q in RATIOS:
        ra, rb = results.get(a), results.get(b)
        if ra and rb and ra.get(q) and rb.get(q):
            ratio = f"{ra[q] / rb[q]:.3f}"
            key = "round_sec_per_update" if q == "sec_per_update" else f"round_{q}"
            a_rounds, b_rounds = ra.get(key) or {}, rb.get(key) or {}
            each = [a_rounds[k] / b_rounds[k] for k in a_rounds if k in b_rounds and b_rounds[k]]  # round by round
            if len(each) > 1:
                ratio += f" ({min(each):.3f} - {max(each):.3f} over {len(each)} rounds)"
            rows.append(f"| {label} | {ratio} |")
    if rows:
        out += ["", "| ratio (below 1: the first smaller / faster; of the medians over all timed updates) | value (range of the rounds' ratios) |",
                "|---|---:|", *rows]
    out.append("")
    if peak:
        out.append(f"MFU = FLOPs / seconds / {peak:.0f} TFLOP/s ({meta.get('peak_note')}); FLOPs/update = "
                   "2 N_pol T (generation) + 2 (2 N_pol + N_val + N_rew) T (old log-probs, reference, value, reward) + "
                   "epochs x 6 (N_pol + N_val) T (training), T = batch x (mean prompt + response length), "
                   "N = matmul parameters; the update's MFU counts the training FLOPs over the update phase's seconds. "
                   + (f"Sampling bound: the policy's bf16 weights and the rows' KV cache read once per decode step at "
                      f"{bandwidth / 1e12:.2f} TB/s (benchmarks/gpu.py)." if bandwidth else ""))
    notes = ["Allocators: ppo_lab runs with expandable segments (its default, memory.cuda_allocator), TRL with the caching "
             "allocator's defaults, unless PYTORCH_CUDA_ALLOC_CONF was set for every runner (each runner's line says)."]
    for name, r in results.items():
        extra = []
        if name.startswith("ppo_lab"):
            extra.append(f"old log-probs from {r.get('old_logprobs_from')}, decode {r.get('decode')}"
                         + (f" (graph kept in {r.get('cuda_graph_kept')})" if r.get("decode") == "cuda_graph" else "")
                         + f", allocator {r.get('cuda_allocator')}"
                         + f", {r.get('optimizer')}, mean response length {r.get('response_length_mean')}"
                         + f", sharding {r.get('sharding')}, frozen weights {r.get('frozen_weights')}, first KL {r.get('first_kl')}")
            if r.get("profile_file"):
                extra.append(f"profile in {Path(r['profile_file']).name} ({r.get('update_s_under_profiler')} s under the profiler)")
            if r.get("profile_error"):
                extra.append(f"profile failed: {r['profile_error']}")
            src = r.get("ppo_lab") or {}
            extra.append(f"ppo_lab from {src.get('path')} {src.get('commit', '')}".rstrip())
        else:
            extra.append(f"allocator {r.get('alloc_conf') or 'default'}, accelerator mixed precision {r.get('trl_mixed_precision')}"
                         + (f", rollout autocast {r.get('rollout_autocast')}" if "rollout_autocast" in r else "")
                         + f", {r.get('optimizer')}")
        phases = ", ".join(f"{k} {v:.3f}" for k, v in (r.get("phase_median_s") or {}).items())
        extra.append(f"phases (s, median) {phases}; first update {r.get('first_update_s')} s")
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


def device_meta(results: dict, args) -> dict:
    gpu = next((r.get("gpu") for r in results.values() if r.get("gpu")), None)
    if not gpu:
        return {}
    peak, note = (args.peak_tflops, "given") if args.peak_tflops else peak_for(gpu)
    return {"peak_tflops": peak, "peak_note": note, "bandwidth": args.bandwidth or bandwidth_for(gpu)}


def main(argv=None):
    args = parse_args(argv)
    if args.table_from:
        lines: dict[str, list[dict]] = {}
        for line in Path(args.table_from).read_text().splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                lines.setdefault(r["bench"], []).append(r)
        results = {k: merge_rounds(v) for k, v in lines.items()}
        meta = {**device_meta(results, args), "rounds": max(len(v) for v in lines.values())}
        print(table(results, {}, meta), end="")
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
    if device != "cuda" and "ppo_lab_graph" in names:
        names.remove("ppo_lab_graph")  # (CUDA graphs need CUDA)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    raw_path, table_path, log_path = out / f"gpu-{stamp}.jsonl", out / f"gpu-{stamp}.md", out / f"gpu-{stamp}.stderr.log"
    profile_path = out / f"gpu-{stamp}.profile-ppo_lab.txt"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRL_EXPERIMENTAL_SILENCE="1",
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if args.alloc_conf:  # the same allocator for every runner, TRL's too
        env["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    common = flags(size) + ["--device", device, "--precision", precision] + list(args.extra)
    print(f"gpu.py: device {device}, precision {precision}, {args.rounds} rounds of runners {', '.join(names)}; "
          f"writing {out}/gpu-{stamp}.*", file=sys.stderr, flush=True)

    lines: dict[str, list[dict]] = {}
    failed: dict[str, str] = {}
    meta: dict = {"config": {**size, "precision": precision}, "rounds": args.rounds}
    t_start = time.perf_counter()
    with open(raw_path, "w") as raw, open(log_path, "w") as log:
        for round_ in range(args.rounds):
            for name in names:
                if name in failed:
                    continue
                elapsed = time.perf_counter() - t_start
                if elapsed > args.budget_s:
                    if name not in lines:
                        failed[name] = f"skipped (time budget: {elapsed:.0f} s > {args.budget_s:.0f} s)"
                    print(f"{name}, round {round_ + 1}: skipped (time budget)", file=sys.stderr, flush=True)
                    continue
                cmd = [args.python, str(HERE / RUNNERS[name][0]), *common, *RUNNERS[name][1:]]
                if args.profile and name == "ppo_lab_separate" and round_ == args.rounds - 1:
                    cmd += ["--profile", str(profile_path)]
                t0 = time.perf_counter()
                r, why, stdout = run_one(f"{name} round {round_ + 1}", cmd, env, log, max(10.0, args.hard_limit_s - elapsed))
                if r is None:
                    if name not in lines:
                        failed[name] = why
                    tail = "\n".join(log_path.read_text().splitlines()[-12:])
                    print(f"{name}: {why}\n{tail}", file=sys.stderr, flush=True)
                    continue
                r["bench"], r["round"] = name, round_ + 1
                r["alloc_conf"] = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF")
                r["runner_wall_s"] = round(time.perf_counter() - t0, 1)
                lines.setdefault(name, []).append(r)
                raw.write(json.dumps(r) + "\n")
                raw.flush()
                print(f"{name}, round {round_ + 1}: {r['sec_per_update']:.3f} s/update, {r['tokens_per_s']:.0f} tokens/s, "
                      f"peak reserved {r.get('gpu_peak_reserved_gib')} GiB, {r['runner_wall_s']} s in all",
                      file=sys.stderr, flush=True)
                results = {k: merge_rounds(v) for k, v in lines.items()}
                table_path.write_text(table(results, failed, {**meta, **device_meta(results, args)}))
    results = {k: merge_rounds(v) for k, v in lines.items()}
    text = table(results, failed, {**meta, **device_meta(results, args)})
    table_path.write_text(text)
    print()
    print(text)
    print(f"total {time.perf_counter() - t_start:.0f} s; raw results {raw_path}, table {table_path}, runner logs {log_path}"
          + (f", profile {profile_path}" if profile_path.exists() else ""), file=sys.stderr)
    if failed and not results:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
