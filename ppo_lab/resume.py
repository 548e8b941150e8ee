"""Resuming a run: what a checkpoint holds besides the weights, and how it is put back (chapter 9).

A resumed run continues exactly as the unbroken run would have (tests/test_faults.py checks it
metric for metric): besides the weights and the optimizer and scheduler state, a checkpoint
holds the KL controllers, the iteration and skipped-update counts, the prompt order and its
generator, every global random generator, and the history. The files and their guarantees
(atomic, verified, safe to load) are `checkpoint.py`'s.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from .checkpoint import (
    checkpoint_name,
    find_checkpoint,
    load_checkpoint,
    random_state,
    restore_random_state,
    save_checkpoint,
    warn_if_config_changed,
)
from .config import upgrade


def _has_critic(folder: Path) -> bool:
    """Whether a sharded checkpoint's folder holds a critic's weights."""
    from torch.distributed.checkpoint import FileSystemReader

    return any(key.startswith("models.critic.") for key in FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def _models(trainer) -> dict:
    """The trained models by role, without accelerate's wrappers."""
    return {"policy": trainer.bare(trainer.policy), "critic": trainer.bare(trainer.critic) if trainer.critic is not None else None}


def save_trainer_checkpoint(trainer) -> Path:
    """Write a full checkpoint of `trainer` (a `PPOTrainer`) to output_dir/checkpoints: weights,
    optimizer, scheduler, KL controllers, prompt order, every random generator, the history."""
    root = trainer.output_dir / "checkpoints"
    path = root / checkpoint_name(trainer.iteration)
    sharded = trainer.sharding.distributed  # the weights and the optimizer written by every process (DCP)
    folder = root / f"{path.name}.tmp-sharded"  # (the same name on every process; a killed write's is removed like the others)
    if sharded:
        if trainer.accelerator.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(folder, ignore_errors=True)  # a crashed save's leftovers
        trainer.accelerator.wait_for_everyone()
        trainer.sharding.save_state(folder, _models(trainer), trainer.optimizer)
        trainer.accelerator.wait_for_everyone()
    if trainer.accelerator.is_main_process:
        rng, generators = random_state()
        tensors, objects = {"rng": rng}, {"scheduler": trainer.scheduler.state_dict()}
        if not sharded:
            tensors["policy"] = trainer.bare(trainer.policy).state_dict()
            if trainer.critic is not None:
                tensors["critic"] = trainer.bare(trainer.critic).state_dict()
            objects["optimizer"] = trainer.optimizer.state_dict()
        state = {
            "iteration": trainer.iteration, "bad_updates": trainer.health.bad_updates, "kl_ctl": trainer.kl_ctl.state_dict(),
            "penalty_ctl": trainer.penalty_ctl.state_dict() if trainer.penalty_ctl is not None else None,
            "prompts": trainer.prompt_stream.state_dict(), **generators,
            "history": trainer.history, "config": trainer.config.to_dict(), "run_id": trainer.run_id,
            "score_map": [trainer.score_gain, trainer.score_bias],
        }
        path = save_checkpoint(root, trainer.iteration, tensors, objects, state, keep=trainer.config.run.keep_checkpoints,
                               folders={"sharded": folder} if sharded else None)
    trainer.accelerator.wait_for_everyone()
    return path


def load_trainer_checkpoint(trainer, where: str | Path) -> Path:
    """Restore `trainer` (a `PPOTrainer`) from a checkpoint folder, or "latest" in output_dir/checkpoints
    (see `checkpoint.find_checkpoint` for the fallback past a corrupted one); returns its path."""
    path = find_checkpoint(where, trainer.output_dir)
    tensors, objects, state = load_checkpoint(path)
    if "prompts" not in state:  # written before the trainer kept its prompt order as `prompts`
        raise ValueError(
            f"checkpoint {str(path)!r} was written by an earlier version of ppo_lab and cannot be resumed by this "
            "one (its optimizer and prompt state are laid out differently); its weights are intact in "
            "policy.safetensors (and critic.safetensors) in that folder"
        )
    warn_if_config_changed(state["config"], trainer.config.to_dict(), path)
    folder_run_id = trainer.out.run_id()
    if state.get("run_id") and folder_run_id is not None and folder_run_id != state["run_id"]:
        raise ValueError(
            f"checkpoint {str(path)!r} belongs to another run than the one in run.output_dir {str(trainer.output_dir)!r} "
            "(its run.json names a different run); resume into the checkpoint's own run.output_dir"
        )
    sharded = (path / "sharded").is_dir()  # written by FSDP2's processes: read on any number of processes
    if trainer.critic is not None and "critic" not in tensors and not sharded:
        raise ValueError(f"checkpoint {str(path)!r} has no critic, but this run uses a separate critic")
    if sharded and trainer.critic is not None and not _has_critic(path / "sharded"):
        raise ValueError(f"checkpoint {str(path)!r} has no critic, but this run uses a separate critic")
    if trainer.sharding.distributed and not sharded:
        raise ValueError(f"checkpoint {str(path)!r} was written without sharding; resume it with memory.sharding = 'none'")
    try:
        if sharded:
            trainer.sharding.load_state(path / "sharded", _models(trainer), trainer.optimizer)
        for role, model in (("policy", trainer.policy), ("critic", trainer.critic)) if not sharded else ():
            if model is not None:  # (checkpoints of compiled runs written before the wrapper was stripped)
                trainer.bare(model).load_state_dict({k.replace("_orig_mod.", ""): t for k, t in tensors[role].items()})
        if not sharded:
            trainer.optimizer.load_state_dict(objects["optimizer"])
    except (RuntimeError, ValueError, CheckpointException) as err:  # (DCP's is a BaseException)
        lines = str(err).strip().splitlines()
        detail = next((x.strip() for x in lines if "size mismatch" in x or "Missing" in x or "Unexpected" in x or "groups" in x), lines[0] if lines else "")
        raise ValueError(f"checkpoint {str(path)!r} does not fit the models of this configuration: {detail[:240]}" + (" ..." if len(detail) > 240 else "")) from err
    trainer.scheduler.load_state_dict(objects["scheduler"])
    trainer.kl_ctl.load_state_dict(state["kl_ctl"])
    if trainer.penalty_ctl is not None and state["penalty_ctl"] is not None:
        trainer.penalty_ctl.load_state_dict(state["penalty_ctl"])
    trainer.run_id = state.get("run_id", trainer.run_id)
    saved_norm = upgrade(state["config"]).get("reward", {}).get("reference_norm", "none")
    if saved_norm != trainer.config.reward.reference_norm:
        raise ValueError(
            f"checkpoint {str(path)!r} was trained with reward.reference_norm = {saved_norm!r}, this run asks for "
            f"{trainer.config.reward.reference_norm!r}: the scores would change scale mid-run; resume with {saved_norm!r}"
        )
    trainer.score_gain, trainer.score_bias = state.get("score_map", (1.0, 0.0))  # reward.reference_norm's, fitted once
    if trainer.config.run.iterations < state["iteration"]:  # it would train nothing and rewrite config.yaml to contradict the log
        raise ValueError(
            f"run.iterations = {trainer.config.run.iterations} is below the iteration of checkpoint {str(path)!r} "
            f"({state['iteration']}): there is nothing to resume; set run.iterations above {state['iteration']}"
        )
    trainer.iteration, trainer.health.bad_updates, trainer.history = state["iteration"], state["bad_updates"], state["history"]
    trainer.prompt_stream.load_state_dict(state["prompts"])
    restore_random_state(tensors["rng"], state)
    return path
