"""Checkpoints that survive being killed: atomic, verified, safe to load.

Chapter 9 (Scaling up) reads this module. A checkpoint is a folder

    checkpoints/checkpoint-000040/
        policy.safetensors, critic.safetensors, rng.safetensors   tensors (safetensors)
        optimizer.pt, scheduler.pt                                 state dicts (torch.save)
        trainer_state.json                                         step, KL controllers, RNG, history
        manifest.json                                              size and sha256 of every file

and three rules make it trustworthy:

1. Atomic. Everything is written into `checkpoint-000040.tmp-<pid>/`, flushed to disk, and the
   folder is renamed to its final name only when complete; `manifest.json` is the last file
   written. A process killed at any moment leaves either the new checkpoint or none, and the
   previous one is never touched. Old ones are deleted only after the new one is in place.
2. Verified. Loading checks every file against the manifest (size, then sha256), so a truncated
   or corrupted checkpoint is found and named, and `latest_checkpoint` falls back to the
   previous one with a warning.
3. Safe. Weights are safetensors (no code runs on load); the optimizer and scheduler state dicts
   go through `torch.load(weights_only=True)`, which refuses anything but tensors and plain
   containers; the rest is JSON.

Tied weights (GPT-2's `lm_head.weight` is `transformer.wte.weight`) are stored once; the alias
is recorded in the manifest and restored on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

MANIFEST = "manifest.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint folder that is incomplete, corrupted, or not a checkpoint."""


def checkpoint_name(iteration: int) -> str:
    """The folder name of iteration `iteration`'s checkpoint, `checkpoint-000003`: zero-padded, so
    that the names sort by iteration."""
    return f"checkpoint-{iteration:06d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _dedupe(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Contiguous CPU copies, one per storage; `aliases` maps a dropped name to the kept one."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state_dict.items():
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = t.to("cpu").contiguous()
    return kept, aliases


def _write_file(path: Path, write) -> None:
    """Write one file through `write(path)` and flush it to disk."""
    write(path)
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def save_checkpoint(
    root: str | Path,
    iteration: int,
    tensors: dict[str, dict[str, torch.Tensor]],
    objects: dict[str, object],
    state: dict,
    keep: int | None = None,
    folders: dict[str, Path] | None = None,
) -> Path:
    """Write checkpoint `iteration` under `root` atomically; keep the newest `keep` ones.

    Args:
        root: the folder holding the checkpoints (created if missing).
        iteration: the step number, in the folder name.
        tensors: name -> state dict, each written as `name.safetensors`.
        objects: name -> state dict of tensors and plain containers (optimizer, scheduler),
            each written as `name.pt` and read back with `weights_only=True`.
        state: JSON-serialisable trainer state, written as `trainer_state.json`.
        keep: delete all but the newest `keep` complete checkpoints afterwards (None: keep all).
        folders: name -> a folder already written (a sharded checkpoint's, by every process),
            moved into the checkpoint as `name/` and covered by the manifest like the files.

    Returns:
        The final folder.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(iteration)
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    manifest: dict = {"format": 1, "iteration": iteration, "files": {}, "aliases": {}}
    try:
        for name, sd in tensors.items():
            kept, aliases = _dedupe(sd)
            manifest["aliases"][name] = aliases
            _write_file(tmp / f"{name}.safetensors", lambda p, kept=kept: save_file(kept, str(p)))
        for name, obj in objects.items():
            _write_file(tmp / f"{name}.pt", lambda p, obj=obj: torch.save(obj, p))
        _write_file(tmp / "trainer_state.json", lambda p: p.write_text(json.dumps(state)))
        for name, folder in (folders or {}).items():
            Path(folder).rename(tmp / name)
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            manifest["files"][path.relative_to(tmp).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        _write_file(tmp / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1)))
        _fsync_dir(tmp)
    except (OSError, RuntimeError, SafetensorError) as err:
        # A full disk (torch reports it as a RuntimeError from its C++ writer): the partial
        # folder is removed, so it does not go on filling the disk; older checkpoints stay.
        shutil.rmtree(tmp, ignore_errors=True)
        reason = write_failure_reason(err, root)
        earlier = list_checkpoints(root)
        kept = f"the earlier checkpoints are intact (the newest: {earlier[0].name})" if earlier else "there is no earlier checkpoint"
        raise OSError(f"could not write checkpoint {str(final)!r} ({reason}); {kept}") from err
    if final.exists():  # an older checkpoint of the same iteration (a re-run): replace it
        old = root / f"{final.name}.old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    if keep is not None:
        for stale in list_checkpoints(root)[keep:]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def write_failure_reason(err: BaseException, folder: Path) -> str:
    """Why a write failed, in words: torch's C++ writer reports a full disk as "[enforce fail at
    inline_container.cc:...] unexpected pos", so a disk with (almost) nothing free is named as such."""
    reason = getattr(err, "strerror", None) or (str(err).strip().splitlines() or [type(err).__name__])[0]
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return reason
    if free < 64 * 2**20 and "space" not in reason.lower():
        return f"no space left on the device: {free / 2**20:.1f} MiB free; the writer said: {reason}"
    return reason


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint folders under `root`, newest first (temporary folders are not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def remove_partial(root: str | Path) -> list[Path]:
    """Delete the temporary folders left by writers that were killed; returns what was removed."""
    root = Path(root)
    gone = [p for p in root.glob("checkpoint-*.tmp-*") if p.is_dir()] if root.is_dir() else []
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def verify_checkpoint(path: str | Path) -> dict:
    """Check every file of a checkpoint against its manifest; returns the manifest.

    Raises `CheckpointError` naming the first problem: no manifest (the write never finished),
    a missing file, a wrong size (truncated), or a wrong sha256 (corrupted).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist or is not a folder")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: it has no {MANIFEST} (its write never finished)") from None
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r} has an unreadable {MANIFEST} ({err})") from None
    if not isinstance(files, dict) or not all(isinstance(m, dict) and {"bytes", "sha256"} <= m.keys() for m in files.values()):
        raise CheckpointError(f"checkpoint {str(path)!r} has an unreadable {MANIFEST} (every file needs its bytes and sha256)")
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {name} is missing")
        if f.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: {name} has {f.stat().st_size} bytes, the manifest says {meta['bytes']}")
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: the sha256 of {name} does not match the manifest")
    return manifest


def load_checkpoint(path: str | Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, object], dict]:
    """Verify and read a checkpoint: (tensors, objects, state), the three arguments of `save_checkpoint`."""
    from safetensors.torch import load_file

    path = Path(path)
    manifest = verify_checkpoint(path)
    tensors, objects = {}, {}
    for name in manifest["files"]:
        if "/" in name:  # a folder's file (a sharded checkpoint's), read by its own loader
            continue
        stem, suffix = name.rsplit(".", 1)
        if suffix == "safetensors":
            sd = load_file(str(path / name))
            for alias, target in manifest["aliases"].get(stem, {}).items():
                sd[alias] = sd[target]
            tensors[stem] = sd
        elif suffix == "pt":
            # weights_only: a checkpoint from elsewhere cannot run code when it is loaded
            objects[stem] = torch.load(path / name, map_location="cpu", weights_only=True)
    state = json.loads((path / "trainer_state.json").read_text())
    return tensors, objects, state


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` that verifies; each bad newer one is warned about."""
    return latest_checkpoint_from(list_checkpoints(root))


def latest_checkpoint_from(candidates: list[Path]) -> Path | None:
    """The first of `candidates` (newest first) that verifies, warning about each one that does not."""
    for path in candidates:
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            warnings.warn(f"{err}; using the previous checkpoint", stacklevel=2)
            continue
        return path
    return None


# --- what a resumed run needs besides the weights --------------------------------------------


def random_state() -> tuple[dict[str, torch.Tensor], dict]:
    """Every global random generator: torch's (and CUDA's) as tensors, Python's and NumPy's as
    JSON, for `save_checkpoint`'s `tensors["rng"]` and its JSON state."""
    import random

    import numpy as np

    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    kind, keys, *rest = np.random.get_state()
    return rng, {"python_random": to_json(random.getstate()), "numpy_random": [kind, keys.tolist(), *rest]}


def restore_random_state(rng: dict[str, torch.Tensor], state: dict) -> None:
    """The inverse of `random_state`."""
    import random

    import numpy as np

    random.setstate(from_json(state["python_random"]))
    kind, keys, *rest = state["numpy_random"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def to_json(state: tuple) -> list:
    """A `random.getstate()`-style tuple as nested lists (JSON has no tuples)."""
    return [list(x) if isinstance(x, tuple) else x for x in state]


def from_json(state: list) -> tuple:
    """The inverse of `to_json`: nested lists back to a `random.getstate()`-style tuple."""
    return tuple(tuple(x) if isinstance(x, list) else x for x in state)


def resolve_resume_from(where: str | Path, output_dir: str | Path) -> Path | None:
    """The folder `run.resume_from = where` names, None for "latest". An iteration number (`3`) or a
    checkpoint's name as `ls` shows it (`checkpoint-000003`) is looked up in
    output_dir/checkpoints; any other value is a path. A folder the user named must exist: a
    typo is an error, never the previous checkpoint. A saved model (a final `policy/`) is named
    as one: it holds weights only, not the optimizer and the rest a resume needs."""
    text = str(where).strip()
    if text == "latest":
        return None
    root = Path(output_dir) / "checkpoints"
    if text.isdigit():
        path = root / checkpoint_name(int(text))
    elif not Path(text).exists() and (root / text).exists():
        path = root / text
    else:
        path = Path(text)
    if not path.is_dir():
        have = [p.name for p in list_checkpoints(root)] if root.is_dir() else []
        listed = f"the checkpoints in {str(root)!r} are: {', '.join(have)}" if have else f"{str(root)!r} holds no checkpoint"
        raise ValueError(f"run.resume_from = {text!r}: there is no checkpoint folder {str(path)!r}; {listed} (or use 'latest')")
    if not (path / MANIFEST).exists() and ((path / "config.json").exists() or (path / "model.safetensors").exists()):
        raise ValueError(
            f"run.resume_from = {text!r}: {str(path)!r} is a saved model, not a checkpoint (it holds the weights only); "
            f"resume from a folder in {str(root)!r}, or start a new run from the model with policy.model = {str(path)!r}"
        )
    return path


def find_checkpoint(where: str | Path, output_dir: str | Path) -> Path:
    """The checkpoint that `run.resume_from = where` names (`resolve_resume_from`): "latest" (the
    newest valid one in output_dir/checkpoints), an iteration, a checkpoint's name or a folder. A
    folder that fails verification is named in a warning and the previous checkpoint beside it is
    used instead; with none left, ValueError."""
    named = resolve_resume_from(where, output_dir)
    if named is None:
        root = Path(output_dir) / "checkpoints"
        path = latest_checkpoint(root)
    else:
        where = named
        root = named.parent
        try:
            verify_checkpoint(where)
            path = Path(where)
        except CheckpointError as err:
            older = [p for p in list_checkpoints(root) if _iteration_of(p) < _iteration_of(Path(where))]
            warnings.warn(f"{err}; trying the previous checkpoint", stacklevel=3)
            path = latest_checkpoint_from(older)
    if path is None:
        raise ValueError(f"no valid checkpoint to resume from in {str(root)!r} (run.resume_from = {str(where)!r})")
    return path


def _iteration_of(path: Path) -> int:
    digits = "".join(ch for ch in path.name.split(".")[0] if ch.isdigit())
    return int(digits) if digits else -1


def warn_if_config_changed(saved: dict, now: dict, path: Path) -> None:
    """Warn when the run being resumed was configured differently where it matters (every
    setting not marked `resume="free"`). Both are `PPOConfig.to_dict()`s; a checkpoint written
    before the groups has flat names, which `config.upgrade` moves to their groups."""
    from .config import free_on_resume, upgrade

    def dotted(groups: dict) -> dict:
        return {f"{key}.{name}": value for key, values in upgrade(groups).items() if isinstance(values, dict) for name, value in values.items()}

    saved, now, free = dotted(saved), dotted(now), free_on_resume()
    changed = sorted(k for k in now if k not in free and k in saved and saved[k] != now[k])
    if changed:
        detail = ", ".join(f"{k}: {saved[k]!r} -> {now[k]!r}" for k in changed)
        warnings.warn(f"resuming {str(path)!r} with a different configuration ({detail}); the run will not match an unbroken one", stacklevel=4)
