"""Execute the chapters under many book seeds and count, for every named check, the seeds it passed.

A chapter's claims about a training run hold for the runs someone looked at; this sweep is how
the book finds out whether they hold for runs nobody looked at. Each hidden check of a chapter is
a named `ppo_lab.book.check(...)`; here a chapter runs with `PPO_LAB_BOOK_STRICT=0` and
`PPO_LAB_BOOK_CHECK_LOG` set, so a failed check is recorded and the chapter goes on, and one
failure cannot hide the rest of the page's checks.

    python book/_scripts/sweep.py run PAGE --seed N [--threads T] [--aten default] --out FILE
    python book/_scripts/sweep.py sweep [PAGE ...] --seeds 53-64 [--threads T] [--aten default] [--jobs J] --out FILE
    python book/_scripts/sweep.py table FILE [FILE ...] [--out book/sweep.md]

`run` executes one page once; `sweep` runs every page (default: all executable chapters in
_toc.yml) under every seed, with one thread unless told otherwise; `make sweep` runs the book's
seeds so, and three of them once more under `ATEN_CPU_CAPABILITY=default` with 2 threads
(another instruction set and another reduction order: another machine in miniature). Each run appends one JSON line to FILE; a (page, seed,
threads, aten) already in FILE for the same version of the page (a hash of its code cells) is not
run again, so an interrupted sweep resumes and an edited page is run afresh. `table` writes
the markdown table the README and the book's project page link: every check, the runs it passed, the seeds where it did not.

A page is executed cell by cell with `exec` in one namespace in a fresh Python process (the
check cells need no Jupyter kernel, so the sweep also runs where Jupyter is not installed); its
code cells are read from the MyST source by `code_cells`, which a test keeps equal to jupytext's.
A cell that raises anything but a check stops the page, as in a kernel: the error is recorded
and the checks it did not reach count as failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHECK_NAME = re.compile(r'check\(\s*"([^"]+)"')


def code_cells(md: Path) -> list[str]:
    """The sources of a MyST-NB page's code cells, in order (options and metadata dropped)."""
    lines = md.read_text().split("\n")
    cells, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```{code-cell}"):
            i += 1
            if i < len(lines) and lines[i] == "---":  # a YAML metadata block
                i += 1
                while lines[i] != "---":
                    i += 1
                i += 1
            while i < len(lines) and lines[i].startswith(":"):  # `:tags: [...]` options
                i += 1
            start = i
            while lines[i] != "```":
                i += 1
            cells.append("\n".join(lines[start:i]).strip("\n"))  # as jupytext reads it
        i += 1
    return cells


def check_names(md: Path) -> list[str]:
    """Every check name written in the page, in order of appearance."""
    names = []
    for src in code_cells(md):
        for name in CHECK_NAME.findall(src):
            if name not in names:
                names.append(name)
    return names


def pages() -> list[Path]:
    sys.path.insert(0, str(HERE))
    from twins import chapters

    return chapters()


def _execute(md: Path) -> None:
    """Child process: run the page's code cells; print one JSON line with the error, if any."""
    import warnings

    warnings.filterwarnings("ignore")
    os.chdir(md.parent)
    namespace: dict = {"__name__": "__main__"}
    error = None
    cells: list[float] = []  # each code cell's seconds: where a page's time goes
    for i, src in enumerate(code_cells(md)):
        start = time.perf_counter()
        try:
            exec(compile(src, f"{md.name} cell {i}", "exec"), namespace)
        except BaseException as e:  # noqa: BLE001 - recorded, the page stops as in a kernel
            error = f"cell {i}: {type(e).__name__}: {str(e)[:300]}"
            break
        finally:
            if "matplotlib.pyplot" in sys.modules:
                sys.modules["matplotlib.pyplot"].close("all")
            cells.append(round(time.perf_counter() - start, 2))
    torch = sys.modules.get("torch")
    sys.__stdout__.write("\n" + json.dumps({"error": error, "torch": getattr(torch, "__version__", ""), "cells": cells}) + "\n")


def run(md: Path, seed: int, threads: int = 1, aten: str = "", commit: str = "") -> dict:
    """Execute `md` once under the given seed, thread count and ATEN_CPU_CAPABILITY; the record."""
    source = _source(md)  # which version of the page ran
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "checks.jsonl"
        env = dict(os.environ, PPO_LAB_BOOK_SEED=str(seed), PPO_LAB_BOOK_THREADS=str(threads),
                   PPO_LAB_BOOK_STRICT="0", PPO_LAB_BOOK_CHECK_LOG=str(log), MPLBACKEND="Agg",
                   HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.pop("PPO_LAB_BOOK_FAIL_CHECK", None)
        if aten:
            env["ATEN_CPU_CAPABILITY"] = aten
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "_exec", str(md)], env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        tail = [line for line in proc.stdout.splitlines() if line.startswith('{"error"')]
        result = json.loads(tail[-1]) if tail else {"error": f"the process ended with code {proc.returncode}: {proc.stderr[-300:]}"}
        error = result["error"]
        checks: dict[str, dict] = {}
        glued: dict[str, str] = {}
        if log.exists():
            for line in log.read_text().splitlines():
                row = json.loads(line)
                if "glue" in row:
                    glued[row["glue"]] = row["value"]
                    continue
                c = checks.setdefault(row["name"], {"calls": 0, "failed": 0, "values": None})
                c["calls"] += 1
                if not row["passed"]:
                    c["failed"] += 1
                    c["values"] = c["values"] or row["values"]
    return {"page": md.name, "source": source, "seed": seed, "threads": threads, "aten": aten or "native", "commit": commit,
            "seconds": round(seconds, 1), "cell_seconds": result.get("cells", []), "error": error, "checks": checks, "glue": glued,
            "machine": f"{_cpu()}, torch {result.get('torch', '?')}, Python {platform.python_version()}"}


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _source(md: Path) -> str:
    """A short hash of the page's code cells: records of a page whose code changed are not taken
    for its runs. Only the code runs, so an edit to the prose keeps the page's runs current."""
    import hashlib

    return hashlib.sha256("\n\0".join(code_cells(md)).encode()).hexdigest()[:12]


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "book", "ppo_lab"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "") if out.returncode == 0 else ""
    except OSError:
        return ""


def _seeds(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _key(record: dict) -> tuple:
    return (record["page"], record["seed"], record["threads"], record["aten"])


def read(files: list[Path]) -> list[dict]:
    records = []
    for f in files:
        if f.exists():
            records += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return records


def sweep(mds: list[Path], seeds: list[int], threads: int, aten: str, jobs: int, out: Path) -> None:
    # resume: a run is done when the same version of the page ran under the same settings
    done = {_key(r) + (r.get("source"),) for r in read([out])}
    commit = os.environ.get("SWEEP_COMMIT") or _commit()
    todo = [(md, s, threads, aten) for md in mds for s in seeds]
    todo = [t for t in todo if (t[0].name, t[1], t[2], t[3] or "native", _source(t[0])) not in done]
    # the longest pages first, so that the last job to finish is a short one
    todo.sort(key=lambda t: -len(t[0].read_text()))
    lock = threading.Lock()
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{len(todo)} runs, {jobs} at a time", flush=True)

    def one(t):
        record = run(*t, commit=commit)
        bad = [n for n, c in record["checks"].items() if c["failed"]]
        with lock:
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{record['page']} seed={record['seed']} threads={record['threads']} aten={record['aten']}: "
                  f"{record['seconds']:.0f} s, {len(record['checks'])} checks, failed {bad or 'none'}"
                  + (f", ERROR {record['error']}" if record["error"] else ""), flush=True)

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, todo))


def table(files: list[Path]) -> str:
    """The markdown table of a sweep: per page, each check with the runs it passed.

    A check is counted over the runs of the page as it is now (the same code cells); runs of an
    earlier version of the page are the sweep's history, listed apart: a check that failed there
    was then weakened, replaced by glued numbers, or removed, and the page's runs began again."""
    records = read(files)
    by_page: dict[str, list[dict]] = {}
    for r in records:
        by_page.setdefault(r["page"], []).append(r)
    order = {md.name: i for i, md in enumerate(pages())}
    machines = sorted({r.get("machine", "?") for r in records})
    seeds = sorted({r["seed"] for r in records if r["threads"] == 1})
    other = sorted({r["seed"] for r in records if r["aten"] != "native"})
    lines = [
        "# The book's claims, swept over seeds",
        "",
        "Every named check of every executed page, run under book seeds that no page was written with",
        "(chosen before any was run), one thread each; three of them once more under",
        "`ATEN_CPU_CAPABILITY=default` with 2 threads. A check passes a run when every call of it held;",
        "a check that a run never reached (the page stopped before it) counts as failed. Made by",
        "`make sweep` (`book/_scripts/sweep.py`); the records are in `book/sweep.jsonl`. The seconds are",
        "those of runs that shared the machine (`SWEEP_JOBS=2`: two pages at a time on 2 cores), not of",
        "a page alone.",
        "",
        "A run counts for a page when it ran the page's code cells as they are now. Runs of an earlier",
        "version are the sweep's history: the checks that failed there were weakened to what held,",
        "replaced by numbers glued into the text, or removed (the check's cell says which), and the",
        "page was swept again; their seeds are listed in the last column.",
        "",
        f"Book seeds: {', '.join(map(str, seeds))}",
        "",
        f"Other instruction set and 2 threads (`*` below): {', '.join(map(str, other)) or 'none yet'}",
        "",
        f"Machine: {'; '.join(machines)}",
        "",
    ]
    # where the sweep stands, from the records themselves, so the table never claims more than it holds
    current = {md.name: [r for r in by_page.get(md.name, []) if r.get("source") == _source(md)] for md in pages()}
    full = [p for p, rs in current.items() if {r["seed"] for r in rs if r["aten"] == "native"} >= set(seeds)]
    part = [f"{p} ({len({r['seed'] for r in rs if r['aten'] == 'native'})})" for p, rs in current.items() if p not in full]
    both = [p for p, rs in current.items() if len({r["seed"] for r in rs if r["aten"] != "native"}) >= 3]
    clean = [p for p in full if not any(r["error"] or any(c["failed"] for c in r["checks"].values()) for r in current[p])]
    lines += [
        f"**Where the sweep stands.** Run under all {len(seeds)} seeds as the page is now: "
        + (", ".join(full) or "none") + "; of these, every check held on every run in: " + (", ".join(clean) or "none")
        + ". Fewer seeds (runs of the page as it is now): " + (", ".join(part) or "none")
        + ". Also run three times under the other instruction set: " + (", ".join(both) or "none") + ".",
        "",
        "| page | runs of the page as it is now (other instruction set) | seconds per run (min / median / max) "
        "| checks | checks that failed a run now | runs that stopped now | runs of earlier versions |",
        "|---|---|---|---|---|---|---|",
    ]
    detail = []
    for page in sorted(by_page, key=lambda p: order.get(p, 99)):
        source = _source(ROOT / "book" / page)
        runs = [r for r in by_page[page] if r.get("source") == source]
        earlier = [r for r in by_page[page] if r.get("source") != source]
        names = check_names(ROOT / "book" / page)
        failed_any, rows = 0, []

        def failures(name: str, rs: list[dict]) -> tuple[list[dict], list[dict]]:
            # the runs that reached the check or stopped before it, and those where it failed
            ran = [r for r in rs if name in r["checks"] or r["error"]]
            return ran, [r for r in ran if name not in r["checks"] or r["checks"][name]["failed"]]

        def seeds_of(rs: list[dict]) -> str:
            return ", ".join(f"{r['seed']}" + ("" if r["aten"] == "native" else "*") for r in sorted(rs, key=lambda r: r["seed"]))

        gone = list(dict.fromkeys(n for r in earlier for n in r["checks"] if n not in names))
        for name in names + gone:
            ran, bad = failures(name, runs)
            _, old_bad = failures(name, earlier)
            failed_any += bool(bad)
            now = f"{len(ran) - len(bad)} / {len(ran)}" if ran else "not swept yet"
            note = "" if name in names else " (no longer in the page)"
            rows.append(f"| {name}{note} | {now if name in names else ''} | {seeds_of(bad)} | {seeds_of(old_bad)} |")
        secs = sorted(r["seconds"] for r in runs if r["aten"] == "native")
        timing = f"{secs[0]:.0f} / {secs[len(secs) // 2]:.0f} / {secs[-1]:.0f}" if secs else ""
        errors = sum(1 for r in runs if r["error"])
        others = sum(1 for r in runs if r["aten"] != "native")
        lines.append(f"| {page} | {len(runs)} ({others}) | {timing} | {len(names)} | {failed_any} | {errors} | {len(earlier)} |")
        detail += ["", f"## {page}", "",
                   "| check | passed (page as it is now) | failed on seeds | failed on seeds, earlier versions |",
                   "|---|---|---|---|"] + rows
        for r in runs:
            if r["error"]:
                detail.append(f"\nseed {r['seed']} ({r['aten']}, {r['threads']} threads) stopped: `{r['error']}`")
    return "\n".join(lines + detail) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["_exec"]:
        _execute(Path(argv[1]))
        return 0
    parser = argparse.ArgumentParser(prog="sweep.py")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("page", type=Path)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--aten", default="")
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("sweep")
    p.add_argument("pages", type=Path, nargs="*")
    p.add_argument("--seeds", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--aten", default="")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("table")
    p.add_argument("files", type=Path, nargs="+")
    p.add_argument("--out", type=Path)
    a = parser.parse_args(argv)
    if a.command == "run":
        record = run(a.page.resolve(), a.seed, a.threads, a.aten, _commit())
        with a.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record, indent=1))
        return 1 if record["error"] or any(c["failed"] for c in record["checks"].values()) else 0
    if a.command == "sweep":
        mds = [m.resolve() for m in a.pages] or pages()
        sweep(mds, _seeds(a.seeds), a.threads, a.aten, a.jobs, a.out)
        return 0
    text = table(a.files)
    if a.out:
        a.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
