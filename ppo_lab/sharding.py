"""Sharded training: each role's weights split over the processes with PyTorch's FSDP2 (chapter 9).

Under DDP every process holds every model whole, so eight GPUs hold per GPU what one holds.
`memory.sharding: fsdp2` splits them instead: `torch.distributed.fsdp.fully_shard` on each
decoder block and on the root of the policy, the reference, a separate critic and a reward
model's backbone, so each process keeps 1/N of every weight, gradient and AdamW moment, and a
block's weights are gathered only while it runs. The trainer reaches it through one object,
`sharding_for`, that it always calls:

- `shard(model)`: wraps a model (after the reference was copied from the policy, since a
  sharded module cannot be deep-copied), under one mixed-precision policy for every role, so
  that the policy and the reference compute alike and the first KL is exactly 0; first, under
  `memory.frozen_weights`, its frozen weights are stored in bf16 (`frozen_in_bf16`: the linear
  layers unsharded, every weight sharded), which changes no output of a bf16 forward;
- `shard_reward(reward_fn)`: the same for a reward model's backbone (its score head stays whole
  and in float32);
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
- `full_state_dict(model, lm)`: the policy's weights gathered whole, for the final save (a LoRA
  policy's are merged on an unsharded copy rebuilt from them, `lora.save_lora`).

Without a process group (a notebook, a script, a test) `fsdp2` makes a world of one, in memory,
which stays for the life of the process. The whole policy is held during sampling (gathered),
so sharding lowers the peak of the rollout less than that of the update.
With `none` every method is what the unsharded trainer did.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

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


def frozen_in_bf16(model, every: bool = False) -> int:
    """Store `model`'s frozen floating-point parameters in bfloat16, in place (the same Parameter
    objects, so ties and references hold); returns how many numbers were converted.

    every=False: only the weights and biases of linear layers (`nn.Linear`, transformers'
    `Conv1D`) whose weight is not also an embedding's (GPT-2 ties its LM head to its input
    embedding, which a lookup reads unrounded). Under bf16 autocast a linear layer rounds a float32
    weight to bfloat16 before every product, so storing it rounded changes no output bit, and a
    frozen model keeps computing exactly what the policy computes from the same weights.
    every=True: every frozen parameter, for a wholly frozen model under FSDP2, whose
    mixed-precision policy rounds them all.
    Trainable parameters (a LoRA adapter, a value head) stay float32.
    """
    from .lora import _linear_kinds

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    converted = 0
    for module in model.modules():
        if not every and not isinstance(module, _linear_kinds()):
            continue
        for p in module.parameters(recurse=False):
            if p.requires_grad or p.dtype not in (torch.float32, torch.float64) or (not every and id(p) in embeddings):
                continue
            p.data = p.data.to(torch.bfloat16)
            converted += p.numel()
    return converted


class NoSharding:
    """DDP through accelerate (or one process): nothing is split."""

    name = "none"

    def __init__(self, frozen_bf16: bool = False):
        self.frozen_bf16 = frozen_bf16  # memory.frozen_weights, resolved

    def shard(self, model):
        """`model` laid out for training: its frozen linear weights in bf16 if asked (`frozen_in_bf16`)."""
        if model is not None and self.frozen_bf16:
            frozen_in_bf16(model)
        return model

    def shard_reward(self, reward_fn):
        """`reward_fn` with its model laid out like the other frozen roles, when it is a reward
        model (`rewards.SequenceClassifierReward`); a decoder's score head is left whole in
        float32, since it runs outside autocast (`rewards.sequence_scores`)."""
        from .rewards import SequenceClassifierReward, reads_at_a_token

        if isinstance(reward_fn, SequenceClassifierReward):
            model = reward_fn.model
            if reads_at_a_token(model):
                self.shard(getattr(model, model.base_model_prefix))
            else:  # an encoder (BERT-style) is left whole: its head is read inside its forward, and
                NoSharding.shard(self, model)  # transformers names no blocks of several of them for sharding
        return reward_fn

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

    def __init__(self, device, precision: str, frozen_bf16: bool = False, head_outside: bool = False):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not dist.is_available():
            raise ValueError("memory.sharding = 'fsdp2' needs torch.distributed, which this build of PyTorch lacks")
        # FSDP2 warns whenever a sharded module returns a view (transformers' outputs hold several):
        # an in-place change of one would skip its gathering hook. ppo_lab changes no forward's
        # output in place, and the tests compare sharded gradients with unsharded ones.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
        if not dist.is_initialized():  # one process (a notebook, a script): a world of one, in memory
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
            _WORLD_OF_ONE[0] = True
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # bf16 weights for compute, float32 gradient reduction; the sharded float32 weights stay the master copy
        self.policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else MixedPrecisionPolicy()
        self.blocks = weakref.WeakSet()  # the decoder blocks sharded, which reshard after each forward
        self.frozen_bf16 = frozen_bf16 and precision == "bf16"
        self.head_outside = head_outside  # memory.logprob_chunk: the LM head is applied after the forward

    def shard(self, model):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if model is None or next(model.parameters(), None) is None or isinstance(model, FSDPModule):
            return model  # nothing of its own to shard (LoRA's reference is the policy with its adapter off), or sharded already
        frozen = not any(p.requires_grad for p in model.parameters())
        if self.frozen_bf16:  # a wholly frozen model all in bf16 (the mixed-precision policy computes with every weight
            frozen_in_bf16(model, every=frozen)  # in bf16); a LoRA base its linear layers, so its export keeps the rest exact
        for block in reversed(decoder_blocks(model)):  # innermost first, as FSDP2 nests
            fully_shard(block, mesh=self.mesh, mp_policy=self.policy)
            self.blocks.add(block)
        inner = getattr(model, "lm", None)  # a shared critic's LM is also called on its own (sampling, LoRA's reference):
        if isinstance(inner, torch.nn.Module):  # as a unit of its own it gathers its weights itself, and like a
            # root keeps them after its forward, for its LM head applied outside it (memory.logprob_chunk)
            fully_shard(inner, mesh=self.mesh, mp_policy=self.policy, reshard_after_forward=False)
        # A root keeps its weights gathered after its forward until the backward (FSDP2's default);
        # a frozen root has no backward, and would keep them for good: it reshards, unless its
        # LM head is applied outside the forward (it gives them back after the chunks, rollout.py)
        head_outside = self.head_outside and callable(getattr(model, "get_output_embeddings", None)) and model.get_output_embeddings() is not None
        fully_shard(model, mesh=self.mesh, mp_policy=self.policy, reshard_after_forward=True if frozen and not head_outside else None)
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

        units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        blocks = [m for m in units if m in self.blocks]  # (the units that reshard after a forward)
        try:
            # The sampling loop may call a module inside the root (a shared critic's LM): the root
            # must be initialised first, or its blocks would each set themselves up as a root.
            # Once initialised, the root keeps its weights after a forward (FSDP2's default).
            model._get_fsdp_state()._lazy_init()  # (no public API for this in torch 2.13)
            for m in blocks:  # one all-gather per block, here, instead of one per block and token
                m.set_reshard_after_forward(False, recurse=False)
            for m in [model, *units]:
                m.unshard()
            yield model
        finally:
            for m in blocks:
                m.set_reshard_after_forward(True, recurse=False)
            for m in [model, *units]:
                m.reshard()


def unsharded_copy(peft_model, state_dict: dict):
    """An unsharded CPU copy of a sharded peft model, holding `state_dict` (its full weights,
    gathered by `full_state_dict`, peft's key names), in the adapter's precision: built empty
    from the config, so it costs one model's memory and no initialisation. A sharded module
    cannot be deep-copied, and `lora.save_lora` merges the adapter on this copy instead."""
    from peft import PeftModel

    base, name = peft_model.get_base_model(), peft_model.active_adapter
    dtype = next(p.dtype for p in peft_model.parameters() if p.requires_grad)
    with torch.device("meta"):
        copy = PeftModel(type(base)._from_config(base.config, dtype=dtype), peft_model.peft_config[name], adapter_name=name)
    copy = copy.to_empty(device="cpu")
    copy.load_state_dict(state_dict, strict=True)  # (each tensor copied in the copy's dtype)
    copy.get_base_model().tie_weights()  # (to_empty gave tied weights a tensor each)
    return copy


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


def sharding_for(memory, device):
    """The sharding object of a `memory` config group (`memory.sharding`, with its precision,
    `frozen_weights` and `logprob_chunk`)."""
    if memory.sharding not in SHARDINGS:
        raise ValueError(f"memory.sharding = {memory.sharding!r}; valid values are: {', '.join(map(repr, SHARDINGS))}")
    frozen_bf16 = memory.frozen_weights == "bf16" or (memory.frozen_weights == "auto" and memory.precision == "bf16")
    if memory.sharding == "fsdp2":
        return FSDP2Sharding(device, memory.precision, frozen_bf16, head_outside=memory.logprob_chunk is not None)
    return NoSharding(frozen_bf16)
