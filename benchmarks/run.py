#!/usr/bin/env python3
"""Run the speed benchmark: ppo_lab (separate and shared critic), TRL's PPOTrainer and the floor.

Each runner is a subprocess that prints one JSON line. The runners alternate, round-robin
(ppo_lab separate, ppo_lab shared, TRL, floor; then again), for `--rounds` rounds, so that a
slow spell of the machine hits all of them alike. Then a markdown table of the medians over the
rounds, the ratios and their goals is printed and written, with every raw JSON line, to
`--out` (default benchmarks/results/).

    python benchmarks/run.py                         # 3 rounds, about 6 minutes on 2 cores
    python benchmarks/run.py --rounds 1 --updates 4  # a quick check
    PPO_LAB_SRC=/path/to/checkout python benchmarks/run.py   # measure another copy of ppo_lab
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

RUNNERS = {
    "ppo_lab_separate": ["ppo_lab_run.py", "--critic", "separate"],
    "ppo_lab_shared": ["ppo_lab_run.py", "--critic", "shared"],
    "trl": ["trl_ppo.py"],
    "floor": ["floor.py", "--critic", "separate", "--hf-generate-reps", "0"],
}
LABELS = {
    "ppo_lab_separate": "ppo_lab, separate critic",
    "ppo_lab_shared": "ppo_lab, shared critic",
    "trl": "TRL 1.12.0 PPOTrainer",
    "floor": "floor (bare loop)",
}

# (name, numerator, denominator, quantity, goal): ratio <= goal passes.
RATIOS = [
    ("time: ppo_lab separate / TRL", "ppo_lab_separate", "trl", "sec_per_update", 0.75),
    ("time: ppo_lab separate / floor", "ppo_lab_separate", "floor", "sec_per_update", 1.05),
    ("time: ppo_lab shared / TRL", "ppo_lab_shared", "trl", "sec_per_update", 0.50),
    ("peak memory: ppo_lab separate / TRL", "ppo_lab_separate", "trl", "peak_rss_mb", 1.00),
    ("peak memory: ppo_lab shared / TRL", "ppo_lab_shared", "trl", "peak_rss_mb", 1.00),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="rounds of the four runners (default 3)")
    p.add_argument("--updates", type=int, default=None, help="PPO updates per run (default: the workload's 16)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every runner (default 1)")
    p.add_argument("--only", default=",".join(RUNNERS), help="comma-separated subset of: " + ", ".join(RUNNERS))
    p.add_argument("--python", default=sys.executable, help="interpreter of the runners (default: this one)")
    p.add_argument("--ppo-lab-src", default=os.environ.get("PPO_LAB_SRC"),
                   help="a checkout whose ppo_lab/ the ppo_lab runners import (put first on PYTHONPATH); "
                        "default: the installed ppo_lab (env PPO_LAB_SRC)")
    p.add_argument("--out", default=str(HERE / "results"), help="folder for the raw JSON lines and the table")
    p.add_argument("--timeout", type=int, default=900, help="seconds before a runner is given up")
    p.add_argument("--table-from", metavar="JSONL", help="only print the table of an earlier run's raw results")
    return p.parse_args(argv)


def run_one(name, args, log):
    cmd = [args.python, str(HERE / RUNNERS[name][0]), *RUNNERS[name][1:], "--threads", str(args.threads)]
    if args.updates is not None:
        cmd += ["--updates", str(args.updates)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRL_EXPERIMENTAL_SILENCE="1")
    if name.startswith("ppo_lab") and args.ppo_lab_src:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(args.ppo_lab_src).resolve()), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=args.timeout)
    log.write(f"===== {name}: {' '.join(cmd)} (exit {proc.returncode}, {time.perf_counter() - t0:.1f} s)\n")
    log.write(proc.stderr[-20000:])
    log.flush()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"runner {name} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def fmt(x, digits=3):
    return "n/a" if x is None else f"{x:.{digits}f}"


def phases_text(rs: list[dict]) -> str:
    keys = list(rs[-1].get("phase_median_s") or {})
    return ", ".join(f"{k} {statistics.median(r['phase_median_s'][k] for r in rs):.3f}" for k in keys)


def table(results: dict[str, list[dict]], meta: dict) -> str:
    med = {name: {q: statistics.median(r[q] for r in rs) for q in ("sec_per_update", "tokens_per_s", "peak_rss_mb")}
           for name, rs in results.items()}
    out = []
    out.append(f"Workload: batch {meta['batch']} x {meta['response_length']} new tokens, {meta['ppo_epochs']} PPO epochs x "
               f"{meta['mini_batches']} minibatches, {meta['updates']} updates per run (the first one is not counted), "
               f"{meta['threads']} torch thread(s); {meta['rounds']} round(s), runners alternating. "
               f"Medians over the rounds.")
    out.append("")
    out.append("| runner | s / update | range over rounds | tokens / s | peak RSS (MB) | phases (s, median) |")
    out.append("|---|---:|---:|---:|---:|---|")
    for name, rs in results.items():
        spu = [r["sec_per_update"] for r in rs]
        out.append(f"| {LABELS[name]} | {med[name]['sec_per_update']:.3f} | {min(spu):.3f} - {max(spu):.3f} | "
                   f"{med[name]['tokens_per_s']:.0f} | {med[name]['peak_rss_mb']:.0f} | {phases_text(rs)} |")
    out.append("")
    out.append("| ratio | measured (medians) | range over rounds | fastest runs | goal | result |")
    out.append("|---|---:|---:|---:|---:|---|")
    for label, a, b, q, goal in RATIOS:
        if a not in results or b not in results:
            continue
        ratio = med[a][q] / med[b][q]
        paired = [ra[q] / rb[q] for ra, rb in zip(results[a], results[b])]
        best = min(r[q] for r in results[a]) / min(r[q] for r in results[b])
        verdict = "PASS" if ratio <= goal else "FAIL"
        out.append(f"| {label} | {ratio:.3f} | {min(paired):.3f} - {max(paired):.3f} | {best:.3f} | <= {goal:.2f} | {verdict} |")
    out.append("")
    out.append("The result is judged on the medians; \"range over rounds\" is each round's pair taken alone, "
               "\"fastest runs\" the ratio of each runner's fastest run (least disturbed by the machine's load).")
    out.append("")
    notes = []
    for name in ("ppo_lab_separate", "ppo_lab_shared"):
        if name in results:
            r = results[name][-1]
            src = r.get("ppo_lab", {})
            notes.append(f"{LABELS[name]}: ppo_lab from {src.get('path')} at {src.get('commit', 'unknown commit')}, "
                         f"ignore_eos={r.get('ignore_eos')}, mean response length {r.get('response_length_mean')}")
    any_r = next(iter(results.values()))[-1]
    notes.append(f"torch {any_r.get('torch')}, transformers {any_r.get('transformers')}, trl {any_r.get('trl')}, "
                 f"Python {any_r.get('python')}, {any_r.get('cpu')} x {any_r.get('nproc')}")
    out += [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.table_from:
        results: dict[str, list[dict]] = {}
        for line in Path(args.table_from).read_text().splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                results.setdefault(r["bench"], []).append(r)
        first = next(iter(results.values()))[0]
        meta = {k: first["config"][k] for k in ("batch", "response_length", "ppo_epochs", "mini_batches", "updates")}
        meta.update(threads=first["config"]["threads"], rounds=max(len(v) for v in results.values()))
        print(table(results, meta), end="")
        return
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RUNNERS))
    if unknown:
        raise SystemExit(f"unknown runner(s) {unknown}; choose from {list(RUNNERS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    raw_path, table_path, log_path = out / f"{stamp}.jsonl", out / f"{stamp}.md", out / f"{stamp}.stderr.log"
    results: dict[str, list[dict]] = {n: [] for n in names}
    with open(raw_path, "w") as raw, open(log_path, "w") as log:
        for rnd in range(1, args.rounds + 1):
            for name in names:
                r = run_one(name, args, log)
                r["round"] = rnd
                raw.write(json.dumps(r) + "\n")
                raw.flush()
                results[name].append(r)
                print(f"round {rnd}/{args.rounds}  {name:18s} {r['sec_per_update']:.3f} s/update  "
                      f"{r['tokens_per_s']:7.1f} tokens/s  peak {r['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    first = results[names[0]][0]["config"]
    meta = {k: first[k] for k in ("batch", "response_length", "ppo_epochs", "mini_batches", "updates")}
    meta.update(threads=args.threads, rounds=args.rounds)
    text = table(results, meta)
    table_path.write_text(text)
    print(text)
    print(f"raw results: {raw_path}\ntable: {table_path}\nrunner logs: {log_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
