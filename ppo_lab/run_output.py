"""A run's folder: what it writes to `output_dir`, and how a folder is claimed, resumed or saved
(chapter 7).

    output_dir/
        metrics.jsonl     one row per iteration (the book's metric names)
        samples.jsonl     the evaluation samples
        checkpoints/      full checkpoints (`checkpoint.py`)
        policy/           the final policy, loadable with `from_pretrained`
        config.yaml       the run's PPOConfig
        run.json          the run's id and the names above, the ones this run owns
        ppo_lab/          accelerate's tracker logs (run.report_to)

Only the main process writes. A run deletes only what a run of ppo_lab recorded as its own: the
names listed in the folder's `run.json`, never a file that merely has one of those names.
- A folder that holds a run's results is refused unless `run.overwrite` (then the old
  run's own files go, and any other file in the folder stays) or `run.resume_from` (then its logs
  are cut back to the checkpoint).
- A folder with no `run.json` that is not empty holds someone else's files: it is refused unless
  `run.overwrite` says to write beside them, and refused in any case when one of them has
  a name the run writes (a `config.yaml` of the user's, say), since the run would replace it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

# What a run writes (recorded in its run.json as its own); run.overwrite removes these and
# nothing else. A folder "holds a run" when it has one of the first four (results).
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "checkpoints", "policy", "config.yaml", "run.json", "ppo_lab")


class RunOutput:
    """The files of one run in `run.output_dir`, written by the main process of `accelerator`."""

    def __init__(self, output_dir: str | Path, accelerator, overwrite: bool = False):
        self.raw = str(output_dir)  # Path("") is Path("."): an empty name must be caught before
        self.dir = Path(output_dir)
        self.accelerator = accelerator
        self.overwrite = overwrite
        self.ready = self.trackers = False

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    def check(self) -> None:
        """A fresh run needs an output_dir it can write that holds no other run (unless
        overwriting) and none of someone else's files the run would replace; checked before
        anything is loaded."""
        if not self.raw.strip():
            raise ValueError("run.output_dir is empty: name a new or empty folder for the run (for example runs/ppo)")
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"run.output_dir {str(self.dir)!r} is a file, not a folder")
        owned = self.owned()
        if owned is None:  # no run of ppo_lab here: whatever the folder holds is someone else's
            others = sorted(p.name for p in self.dir.iterdir() if not p.name.startswith(".write-test-")) if self.dir.is_dir() else []
            clash = [n for n in others if n in RUN_FILES or n.startswith(("policy.tmp-", "policy.old-"))]
            if clash:
                raise ValueError(
                    f"run.output_dir {str(self.dir)!r} holds {', '.join(clash)}, not written by a run of ppo_lab "
                    "(the folder has no run.json); a run would write over them. Choose a new or empty run.output_dir"
                )
            if others and not self.overwrite:
                shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
                raise ValueError(
                    f"run.output_dir {str(self.dir)!r} is not empty and holds no run of ppo_lab ({shown}); choose a "
                    "new or empty run.output_dir, or set run.overwrite to write the run beside those files "
                    "(they are left as they are)"
                )
            return self._probe()
        held = [n for n in RUN_FILES[:4] if n in owned and (self.dir / n).exists()]
        if held and not self.overwrite:
            raise ValueError(
                f"run.output_dir {str(self.dir)!r} already holds a run ({held[0]}); choose another "
                "run.output_dir, set run.overwrite to replace it, or set run.resume_from to continue it"
            )
        self._probe()

    def _record(self) -> dict | None:
        """This folder's run.json as a dict (None when there is none); ValueError naming the file
        when it is not a run record."""
        path = self.dir / "run.json"
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
        except ValueError:
            raise ValueError(f"{str(path)!r} is not readable JSON; delete it if run.output_dir holds only this checkpoint's run") from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{str(path)!r} holds JSON but not a run record (a JSON object; found {type(record).__name__}); "
                "delete it if run.output_dir holds only this checkpoint's run"
            )
        return record

    def owned(self) -> list[str] | None:
        """The names a run of ppo_lab recorded as its own in this folder's run.json; None when the
        folder holds no run.json. A run.json written before runs listed their files owns RUN_FILES."""
        record = self._record()
        if record is None:
            return None
        files = record.get("files", list(RUN_FILES))
        if not isinstance(files, list) or not all(isinstance(n, str) and n in RUN_FILES for n in files):
            raise ValueError(f"{str(self.dir / 'run.json')!r} does not list a run's files as ppo_lab writes them; move the folder's files elsewhere or choose another run.output_dir")
        return files

    def _probe(self) -> None:
        if self.main:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                probe = self.dir / f".write-test-{os.getpid()}"
                probe.write_text("")
                probe.unlink()
            except OSError as err:
                raise ValueError(f"run.output_dir {str(self.dir)!r} cannot be written: {err.strerror or err}") from None

    def prepare(self, *, iteration: int, resumed: bool, config: dict, run_id: str, trackers: bool = False, logged: list[dict] | None = None) -> None:
        """Claim the folder: a fresh run removes an overwritten run's files; a resumed run keeps
        its logs up to the checkpoint's `iteration` and drops what came after it. `logged` (a
        resumed run's) are the metrics rows its checkpoint holds: one that metrics.jsonl lacks (a
        row torn by a kill) is written back, so the log reads 1, 2, 3, ... without a gap."""
        if not resumed:
            self.check()
            self.accelerator.wait_for_everyone()  # every process checked before the main one writes
            if self.main:
                # Overwriting removes everything the old run owned (its checkpoints left in place
                # would be resumed from, or would push the new run's out under run.keep_checkpoints),
                # and nothing else: check() refused a folder where a name the run writes is not its own.
                owned = self.owned() or []
                leftovers = list(self.dir.glob("policy.tmp-*")) + list(self.dir.glob("policy.old-*")) if "policy" in owned else []
                for path in [self.dir / n for n in owned] + leftovers:
                    _remove(path)
        elif self.main:
            for path in [self.dir / n for n in ("metrics.jsonl", "samples.jsonl")]:
                restore = logged if path.name == "metrics.jsonl" else None
                if path.exists() or restore:
                    rows = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
                    rows = [row for row in rows if iteration_of_row(row) <= iteration]
                    have = {iteration_of_row(row) for row in rows}
                    rows += [_json_row(m) for m in restore or [] if m.get("iteration", 0) <= iteration and m.get("iteration", 0) not in have]
                    path.write_text("".join(row + "\n" for row in sorted(rows, key=iteration_of_row)))
        if self.main:
            import yaml

            from .checkpoint import remove_partial

            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            _write_atomic(self.dir / "run.json", json.dumps({"run_id": run_id, "files": list(RUN_FILES)}))
            remove_partial(self.dir / "checkpoints")
            # a final save that was killed: between its two renames the previous policy is
            # policy.old-*, and it is put back; a half-written policy.tmp-* is removed
            old = sorted(self.dir.glob("policy.old-*"))
            if old and not (self.dir / "policy").exists():
                old[0].rename(self.dir / "policy")
            for stale in list(self.dir.glob("policy.tmp-*")) + list(self.dir.glob("policy.old-*")):
                shutil.rmtree(stale, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        if trackers:  # run.report_to: accelerate's trackers (tensorboard, wandb, ...) log to run.output_dir/ppo_lab
            # trackers take flat hyperparameters: one "group.field" key each
            flat = {f"{key}.{name}": v for key, values in config.items() for name, v in values.items()}
            self.accelerator.init_trackers("ppo_lab", config={k: v for k, v in flat.items() if v is not None})
        self.trackers, self.ready = trackers, True

    def log(self, metrics: dict, iteration: int) -> None:
        """One row of metrics.jsonl, and the same numbers to the trackers."""
        self.append("metrics.jsonl", [metrics])
        if self.trackers:
            self.accelerator.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=iteration)

    def run_id(self) -> str | None:
        """The id in run.json, if the folder has one."""
        record = self._record()
        return None if record is None else record.get("run_id")

    def append(self, name: str, rows: list[dict]) -> None:
        """Append rows to a JSONL file (nan and inf become null: strict JSON has neither)."""
        if not self.main:
            return
        with open(self.dir / name, "a") as fh:
            for row in rows:
                fh.write(_json_row(row) + "\n")

    def save_folder(self, folder: str | Path, write) -> Path:
        """Call `write(tmp)` to fill a folder, then move it to `folder` in one rename: a process
        killed while saving leaves the previous folder (or none), never half of one."""
        from safetensors import SafetensorError

        folder = Path(folder)
        if self.main:
            tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                write(tmp)
            except (OSError, RuntimeError, SafetensorError) as err:  # a full disk, a permission
                shutil.rmtree(tmp, ignore_errors=True)
                from .checkpoint import write_failure_reason

                raise OSError(f"could not save the policy to {str(folder)!r} ({write_failure_reason(err, folder.parent)}); nothing was written there") from err
            if folder.exists():
                old = folder.with_name(f"{folder.name}.old-{os.getpid()}")
                folder.rename(old)
                tmp.rename(folder)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(folder)
        self.accelerator.wait_for_everyone()
        return folder


def save_policy(lm, tokenizer, folder, lora: bool = False, state_dict: dict | None = None) -> None:
    """`save_pretrained` of the policy and its tokenizer into `folder`; a LoRA policy is saved
    merged (base + adapter), so that the folder loads without peft. `state_dict`: the policy's
    full weights when `lm`'s own are sharded (`sharding.full_state_dict`)."""
    from .hf import quiet_transformers

    with quiet_transformers():
        if lora:
            from .lora import save_lora

            save_lora(lm, folder, merged=True, state_dict=state_dict)
        else:
            lm.save_pretrained(folder, **({"state_dict": state_dict} if state_dict is not None else {}))
        tokenizer.save_pretrained(folder)


def iteration_of_row(row: str) -> float:
    """The iteration of a metrics or samples row; a torn row (a run killed mid-write) sorts last."""
    try:
        return json.loads(row).get("iteration", 0)
    except ValueError:
        return math.inf


def _json_row(row: dict) -> str:
    """One JSONL row (nan and inf become null: strict JSON has neither)."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()})


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
