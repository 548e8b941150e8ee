"""Sharded training: each role's weights split over the processes with PyTorch's FSDP2 (chapter 9).

Under DDP every process holds every model whole, so eight GPUs hold per GPU what one holds.
`memory.sharding: fsdp2` splits them instead: `torch.distributed.fsdp.fully_shard` on each
decoder block and on the root of the policy, the reference and a separate critic, so each
process keeps 1/N of every weight, gradient and AdamW moment, and a block's weights are
gathered only while it runs. The trainer reaches it through one object, `sharding_for`, that it
always calls:

- `shard(model)`: wraps a model (after the reference was copied from the policy, since a
  sharded module cannot be deep-copied), under one mixed-precision policy for every role, so
  that the policy and the reference compute alike and the first KL is exactly 0;
- `prepare(accelerator, models, optimizer)`: under DDP accelerate wraps the models; sharded
  models are not passed through `prepare` (it would put DDP around them);
- `gathered(model)`: around sampling, the policy's weights gathered once and kept until the
  rollout ends. A sharded forward is a collective, and the sampling loop takes as many steps as
  its longest response, which differs between processes: gathering per token would hang the
  process whose rows stopped first. Gathered, the loop issues no collective at all;
- `save_state` / `load_state`: the models and the optimizer through
  `torch.distributed.checkpoint`, each process writing its shards into one folder (a file
  system every process sees); read back on the same number of processes, or on one unsharded
  process (the two tested); DCP re-cuts the shards for other counts;
- `full_state_dict(model, lm)`: the policy's weights gathered whole, for the final save.

Without a process group (a notebook, a script, a test) `fsdp2` makes a world of one, in memory,
which stays for the life of the process. The whole policy is held during sampling (gathered),
so sharding lowers the peak of the update, not of the rollout.
With `none` every method is what the unsharded trainer did.
"""

from __future__ import annotations

import contextlib

import torch

SHARDINGS = ("none", "fsdp2")
_WORLD_OF_ONE = [False]  # whether this process made its own world of one (below)


def release_world_of_one() -> bool:
    """End the world of one that `fsdp2` made in this process, if it did; True if it did.

    Processes forked from this one (`distributed.launch_processes`) would inherit it and take
    it for their own group, and hang. A sharded trainer built before cannot run after this.
    """
    import torch.distributed as dist

    if not (_WORLD_OF_ONE[0] and dist.is_available() and dist.is_initialized()):
        return False
    dist.destroy_process_group()
    _WORLD_OF_ONE[0] = False
    return True


class NoSharding:
    """DDP through accelerate (or one process): nothing is split."""

    name = "none"

    def shard(self, model):
        return model

    def prepare(self, accelerator, models, optimizer):
        """The prepared models (DDP on several processes) and optimizer."""
        *models, optimizer = accelerator.prepare(*models, optimizer)
        return models, optimizer

    def gathered(self, model):
        return contextlib.nullcontext()

    def state(self, models: dict, optimizer):
        """(the models' and the optimizer's state dicts, keyed by role) in the layout of
        `torch.distributed.checkpoint`: sharded tensors under FSDP2, whole ones otherwise."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        holder = torch.nn.ModuleDict({k: v for k, v in models.items() if v is not None})
        return holder, *get_state_dict(holder, getattr(optimizer, "optimizer", optimizer))

    def save_state(self, folder, models: dict, optimizer) -> None:
        """Write the models and the optimizer with `torch.distributed.checkpoint` into `folder`
        (every process writes its shards; under FSDP2 a collective)."""
        import torch.distributed.checkpoint as dcp

        _, model_sd, optim_sd = self.state(models, optimizer)
        dcp.save({"models": model_sd, "optimizer": optim_sd}, checkpoint_id=str(folder), no_dist=not self.distributed)

    def load_state(self, folder, models: dict, optimizer) -> None:
        """Read what `save_state` wrote, on any number of processes (the shards are re-cut)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        holder, model_sd, optim_sd = self.state(models, optimizer)
        state = {"models": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(folder), no_dist=not self.distributed)
        set_state_dict(holder, getattr(optimizer, "optimizer", optimizer), model_state_dict=state["models"], optim_state_dict=state["optimizer"])

    distributed = False  # whether save_state / load_state are collectives

    def full_state_dict(self, model, lm) -> dict | None:
        """The full (unsharded) weights of `lm` inside `model`, for saving; None: `lm` holds them."""
        return None


class FSDP2Sharding(NoSharding):
    """`fully_shard` on every decoder block and on each model's root, over all the processes."""

    name = "fsdp2"
    distributed = True

    def __init__(self, device, precision: str):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not dist.is_available():
            raise ValueError("memory.sharding = 'fsdp2' needs torch.distributed, which this build of PyTorch lacks")
        if not dist.is_initialized():  # one process (a notebook, a script): a world of one, in memory
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
            _WORLD_OF_ONE[0] = True
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # bf16 weights for compute, float32 gradient reduction; the sharded float32 weights stay the master copy
        self.policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else MixedPrecisionPolicy()

    def shard(self, model):
        from torch.distributed.fsdp import fully_shard

        if model is None or next(model.parameters(), None) is None:
            return model  # nothing of its own to shard (LoRA's reference is the policy with its adapter off)
        for block in reversed(decoder_blocks(model)):  # innermost first, as FSDP2 nests
            fully_shard(block, mesh=self.mesh, mp_policy=self.policy)
        fully_shard(model, mesh=self.mesh, mp_policy=self.policy)
        return model

    def prepare(self, accelerator, models, optimizer):
        return list(models), accelerator.prepare(optimizer)

    def full_state_dict(self, model, lm) -> dict:
        """`lm`'s weights gathered whole on the CPU of the main process (a collective: every process
        calls it; the others get an empty dict), with `lm`'s own key names (a shared critic's
        `lm.` prefix and value head dropped)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if lm is model:
            return full
        prefix = next(name for name, module in model.named_modules() if module is lm) + "."
        return {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}

    @contextlib.contextmanager
    def gathered(self, model):
        from torch.distributed.fsdp import FSDPModule

        blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        try:
            # The sampling loop may call a module inside the root (a shared critic's LM): the root
            # must be initialised first, or its blocks would each set themselves up as a root.
            # Once initialised, the root keeps its weights after a forward (FSDP2's default).
            model._get_fsdp_state()._lazy_init()  # (no public API for this in torch 2.13)
            for m in blocks:  # one all-gather per block, here, instead of one per block and token
                m.set_reshard_after_forward(False, recurse=False)
            for m in [model, *blocks]:
                m.unshard()
            yield model
        finally:
            for m in blocks:
                m.set_reshard_after_forward(True, recurse=False)
            for m in [model, *blocks]:
                m.reshard()


def decoder_blocks(model) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model: the modules whose class the model names in
    `_no_split_modules` (how accelerate finds them too), outermost first."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"memory.sharding = 'fsdp2' found no decoder blocks in {type(model).__name__} (its _no_split_modules names none)")
    return blocks


def sharding_for(name: str, device, precision: str):
    """The sharding object of `memory.sharding`."""
    if name not in SHARDINGS:
        raise ValueError(f"memory.sharding = {name!r}; valid values are: {', '.join(map(repr, SHARDINGS))}")
    return FSDP2Sharding(device, precision) if name == "fsdp2" else NoSharding()
