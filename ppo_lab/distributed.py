"""What changes when a run is split over several processes (`accelerate launch`; chapter 9).

Each process samples and scores its share of the rollout (`shard`); the rollout is gathered so
that every process holds the whole batch (`gather_rollout`: whitening, the KL controller and the
metrics are global); each process trains on its micro-batches of every minibatch, and DDP
averages the gradients, skipping the all-reduce on all but the last micro-batch (`no_sync`).
With one process every helper here is the identity.
"""

from __future__ import annotations

import contextlib
import resource

import torch

from .batch import padding


def check_distributed_backend(kind) -> None:
    """Refuse the accelerate backends under which this trainer is not known to be correct.

    One process, and several (`accelerate launch --multi_gpu`, or CPU processes) under DDP or
    `ppo_lab`'s own FSDP2 (`memory.sharding: fsdp2`, sharding.py) are what runs:
    tests/test_distributed.py and tests/test_sharding.py check that 2 processes compute what 1
    does. accelerate's FSDP and DeepSpeed types would wrap the models their own way (the
    optimizer, the checkpoints, the gradient norm, DeepSpeed's optimizer step inside
    `backward`), which ppo_lab has not run and checked, so they are refused rather than allowed
    to train silently wrong.
    """
    name = getattr(kind, "value", str(kind))
    if name == "NO" or name.startswith("MULTI_"):
        return
    raise ValueError(
        f"accelerate's distributed type {name} is not supported by ppo_lab: it runs on one device, or on "
        "several with DDP (accelerate launch --multi_gpu). To shard the models over the processes, keep accelerate's "
        "type multi-GPU and set memory.sharding: fsdp2 (ppo_lab's own FSDP2); accelerate's FSDP and DeepSpeed "
        "types are refused because their optimizer, checkpoint and gradient-clipping paths are not ppo_lab's"
    )


def shard(accelerator, n: int) -> tuple[int, int]:
    """The rows [lo, hi) of a global batch of n that this process handles."""
    world, rank = accelerator.num_processes, accelerator.process_index
    return rank * n // world, (rank + 1) * n // world


def gather(accelerator, tensor: torch.Tensor, pad_value=0, pad_first: bool = False) -> torch.Tensor:
    """Concatenate every process's rows (after padding dim 1 to the longest)."""
    if accelerator.num_processes == 1:
        return tensor
    if tensor.dim() > 1:
        tensor = accelerator.pad_across_processes(tensor, dim=1, pad_index=pad_value, pad_first=pad_first)
    return accelerator.gather(tensor)


def gather_rollout(accelerator, parts: dict, pad_id: int) -> dict:
    """Every process's share of the rollout's fields, concatenated, each padded by the rollout's
    one rule (`batch.padding`). `parts["responses"]` is a list of str."""
    if accelerator.num_processes == 1:
        return parts
    from accelerate.utils import gather_object

    out = {}
    for key, value in parts.items():
        rule = padding(key, pad_id)
        if key == "responses":
            out[key] = gather_object(value)
        elif value is None:
            out[key] = None
        else:
            fill, front = rule if rule is not None else (0, False)
            bool_ = value.dtype == torch.bool  # (gathered as integers)
            gathered = gather(accelerator, value.long() if bool_ else value, fill, pad_first=front)
            out[key] = gathered.bool() if bool_ else gathered
    return out


def no_sync(accelerator, models, last: bool):
    """Skip DDP's gradient all-reduce on every micro-batch but the last of a minibatch."""
    if last or accelerator.num_processes == 1:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for model in models:
        if model is not None:
            stack.enter_context(accelerator.no_sync(model))
    return stack


def mean_over_processes(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` averaged over the processes (itself when there is one), on every process."""
    return tensor if accelerator.num_processes == 1 else accelerator.reduce(tensor, reduction="mean")


def peak_memory_mb(device) -> float:
    """Peak GPU memory allocated on CUDA (since the last reset), else the process's peak
    resident memory since it started, in MB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def max_peak_memory_mb(accelerator) -> float:
    """This iteration's peak on CUDA (the counter is reset when `step` starts, so evaluation
    and checkpointing in between count for neither), the largest over the processes; on a
    CPU the process's peak since it started (it cannot be reset)."""
    peak = peak_memory_mb(accelerator.device)
    if accelerator.num_processes > 1:
        peak = accelerator.gather(torch.tensor([peak], device=accelerator.device)).max().item()
    return peak


def launch_processes(function, args: tuple = (), num_processes: int = 2) -> None:
    """Run `function(*args)` in `num_processes` processes forked from this one (a notebook, a
    script), as one process group: `accelerate.notebook_launcher` with a free port.

    A `PPOTrainer` built inside `function` sees `num_processes` processes and splits its batches
    over them (on a machine without a GPU, a gloo group on the CPU: `make_accelerator` asks for
    `cpu=True`, without which every process would think it is alone). accelerate refuses to
    launch from a process that has already created an `Accelerator` (any trainer built earlier
    in the same notebook), so this forgets that state first; the caller's trainers keep theirs,
    except a sharded one (`memory.sharding: fsdp2`) in a world of one, whose group is ended.
    """
    import socket

    from accelerate import notebook_launcher
    from accelerate.state import AcceleratorState

    from .sharding import release_world_of_one

    if num_processes < 2:
        raise ValueError(f"num_processes = {num_processes!r}: launch_processes is for 2 or more; call the function directly for one")
    release_world_of_one()  # (a sharded trainer's world of one in this process: the forked processes must not inherit it)
    AcceleratorState._reset_state(reset_partial_state=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    notebook_launcher(function, args, num_processes=num_processes, use_port=str(port))
