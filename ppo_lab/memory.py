"""How much memory a PPO step needs: an estimate from sizes, and a measurement on any device.

Chapter 9 (Scaling up) compares the two. A PPO setup holds up to four models (policy,
reference, critic, reward model), the optimizer's state for the two that train, their
gradients during the update, the activations a backward pass needs, the KV cache while
sampling, and the (B, T, V) logits of every forward. `estimate_memory` adds these up from a
config and the models' shapes (no weights needed), phase by phase; `TensorMemory` measures the
peak of the bytes held by live tensors while a piece of code runs.

Why a tracker of our own: CUDA's caching allocator keeps peak statistics
(`torch.cuda.max_memory_allocated`), the CPU allocator keeps none, and a process's peak
resident memory includes the interpreter and every library (hundreds of MB) and cannot be
reset. `TensorMemory` counts the storages that PyTorch operators return (through a
`TorchDispatchMode`), each once however many views share it, and forgets each when it is
freed; it sees every tensor an operator creates, on any device, and none of the scratch memory
inside an operator. PyTorch has a similar private tool (`torch.distributed._tools.mem_tracker`),
which is not a stable API.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemory(TorchDispatchMode):
    """Peak bytes held by live tensor storages while the `with` block runs.

    Tensors that exist before the block are counted only when passed to `hold` (a model's
    parameters and buffers, an optimizer's state): the measurement is then "everything this
    step needs", comparable with an estimate. Storages are identified by their address, so
    views, in-place results and a tensor registered twice count once.

    Example::

        with TensorMemory() as mem:
            mem.hold(model, optimizer)
            loss = model(x).sum(); loss.backward(); optimizer.step()
        mem.peak  # bytes
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}  # address -> bytes of every storage counted now
        self._records: dict[int, list[int]] = {}  # id of a storage object -> [its address, bytes] as counted
        self._resize = None  # torch.UntypedStorage.resize_ as found on entering (restored on leaving)
        self.current = 0  # bytes held now
        self.peak = 0  # the most bytes held at once since the block began

    def hold(self, *things) -> TensorMemory:
        """Count tensors that already exist: tensors, modules (parameters, their gradients and
        buffers) and optimizers (their state)."""
        for thing in things:
            if isinstance(thing, torch.Tensor):
                self._add(thing)
            elif isinstance(thing, torch.nn.Module):
                for t in [*thing.parameters(), *thing.buffers()]:
                    self._add(t)
                    if t.grad is not None:
                        self._add(t.grad)
            elif isinstance(thing, torch.optim.Optimizer):
                for state in thing.state.values():
                    for t in tree_flatten(state)[0]:
                        if isinstance(t, torch.Tensor):
                            self._add(t)
            elif thing is not None:
                raise TypeError(f"TensorMemory.hold takes tensors, modules and optimizers, got {type(thing).__name__}")
        return self

    def _add(self, t: torch.Tensor) -> None:
        if hasattr(t, "to_local"):  # a sharded DTensor: this process holds its local shard
            t = t.to_local()
        if t.is_meta or t.layout != torch.strided:
            return
        self._add_storage(t.untyped_storage())

    def _add_storage(self, storage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._live:
            return
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        if id(storage) not in self._records:  # one finaliser per storage: it frees what the storage holds when it dies
            weakref.finalize(storage, lambda sid=id(storage): self._free(*self._records.pop(sid, (0, 0))))
        self._records[id(storage)] = [key, size]

    def _free(self, key: int, size: int) -> None:
        if self._live.get(key) == size:
            del self._live[key]
            self.current -= size

    def __enter__(self):
        # FSDP2 frees a gathered weight by resizing its storage to 0 bytes and gathers it again into
        # the same storage; `UntypedStorage.resize_` is no operator this mode sees, so it is watched
        # here, process-wide (as PyTorch's own `torch.distributed._tools.mem_tracker` does)
        if self._resize is not None:
            raise RuntimeError("this TensorMemory is already measuring; use a new one for a nested block")
        original = self._resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            record = self._records.get(id(storage))
            out = original(storage, size)
            if record:
                self._free(*record)
                record[:] = [0, 0]
            self._add_storage(storage)  # (nothing if now empty)
            return out

        torch.UntypedStorage.resize_ = resize_
        try:
            return super().__enter__()
        except BaseException:
            torch.UntypedStorage.resize_, self._resize = original, None
            raise

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_, self._resize = self._resize, None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


# --- the estimate ----------------------------------------------------------------------------

# What autograd keeps per token in one transformer block, in units of the hidden size H: the two
# norms' inputs and outputs, q, k and v, the attention output (8 H in all), plus the MLP's
# intermediate tensors, each r = I / H units wide. How many the MLP keeps depends on how its
# activation is written: GPT-2's tanh approximation ("gelu_new") is five elementwise operators,
# so its backward needs five intermediate tensors; a fused activation keeps its input and the
# output; a gated MLP (Llama, Qwen, Mistral) keeps the gate, the up projection, the activation
# and the product. Without gradients only a few of them are alive at once ("transient").
_MLP_KEPT = {"gelu_new": 5, "fused": 2, "gated": 4}  # I-wide tensors kept for backward
_MLP_TRANSIENT = {"gelu_new": 4, "fused": 2, "gated": 3}  # I-wide tensors alive at once, no grad
_BLOCK_KEPT = 8  # H-wide tensors kept per block besides the MLP's
_BLOCK_TRANSIENT = 4  # H-wide tensors alive at once in a no-grad block besides the MLP's
_OUTSIDE_BLOCKS = 3  # H-wide tensors kept per token outside the blocks (embedding sum, final norm)
_GATED = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "olmo2", "granite", "smollm3")
SHARDINGS = ("none", "zero1", "zero2", "zero3", "fsdp2")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that decide its memory (read from a Hugging Face config).

    `params` counts every parameter (embeddings included); `mlp` is "gelu_new", "fused" or
    "gated" (see `_MLP_KEPT`).
    """

    params: int
    n_layer: int
    hidden: int
    n_head: int
    n_kv_head: int
    head_dim: int
    intermediate: int
    vocab: int
    mlp: str = "fused"
    tied: bool = True  # the LM head is the input embedding (GPT-2, Qwen2.5 up to 3B, Llama-3.2)

    def __post_init__(self):
        if self.mlp not in _MLP_KEPT:
            raise ValueError(f"ModelShape.mlp = {self.mlp!r} is not one of {', '.join(map(repr, _MLP_KEPT))}")
        for name in ("params", "n_layer", "hidden", "n_head", "n_kv_head", "head_dim", "intermediate", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{name} = {value!r} must be a positive integer")

    @classmethod
    def from_config(cls, config, params: int | None = None) -> ModelShape:
        """The shape of a model with this `transformers` config (GPT-2 or Llama-style names).
        Without `params`, the parameter count is computed from the sizes (biases left out)."""
        get = lambda *names: next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)  # noqa: E731
        hidden, n_layer, n_head = get("hidden_size", "n_embd"), get("num_hidden_layers", "n_layer"), get("num_attention_heads", "n_head")
        vocab = get("vocab_size")
        if None in (hidden, n_layer, n_head, vocab):
            raise ValueError(f"cannot read the hidden size, layers, heads and vocabulary of a {type(config).__name__}")
        n_kv = get("num_key_value_heads") or n_head
        head_dim = get("head_dim") or hidden // n_head
        inner = get("intermediate_size", "n_inner") or 4 * hidden
        act = get("hidden_act", "activation_function") or "gelu"
        mlp = "gated" if getattr(config, "model_type", "") in _GATED else ("gelu_new" if act == "gelu_new" else "fused")
        tied = get("tie_word_embeddings") in (None, True)
        if params is None:
            attention = hidden * (n_head + 2 * n_kv) * head_dim + n_head * head_dim * hidden
            mlp_params = (3 if mlp == "gated" else 2) * hidden * inner
            head = 0 if tied else vocab * hidden
            positions = (get("n_positions") or 0) * hidden  # learned positions (GPT-2); rotary has none
            params = vocab * hidden + head + positions + n_layer * (attention + mlp_params + 2 * hidden) + hidden
        return cls(int(params), n_layer, hidden, n_head, n_kv, head_dim, inner, vocab, mlp, tied)

    @classmethod
    def of(cls, model) -> ModelShape:
        """The shape of a loaded model (its parameters counted exactly)."""
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(f"{type(model).__name__} has no `config`: give ModelShape.from_config a transformers config")
        return cls.from_config(config, params=sum(p.numel() for p in model.parameters()))

    @property
    def block_params(self) -> int:
        """Parameters of one decoder block (its projections and two norms; biases left out)."""
        attention = self.hidden * (self.n_head + 2 * self.n_kv_head) * self.head_dim + self.n_head * self.head_dim * self.hidden
        return attention + (3 if self.mlp == "gated" else 2) * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def root_params(self) -> int:
        """Parameters outside the blocks (embeddings, an untied LM head, the final norm), which
        FSDP2's root unit holds."""
        return max(self.params - self.n_layer * self.block_params, 0)

    @property
    def linear_params(self) -> int:
        """Parameters of the linear layers not tied to an embedding (the blocks' projections, an
        untied LM head), which `memory.frozen_weights` keeps in bf16 without sharding."""
        return min(self.n_layer * (self.block_params - 2 * self.hidden) + (0 if self.tied else self.vocab * self.hidden), self.params)

    def lora_params(self, r: int) -> int:
        """Parameters of rank-r adapters on every linear layer of the blocks (all-linear)."""
        qkv_out = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        attention = r * (self.hidden + qkv_out) + r * (self.n_head * self.head_dim + self.hidden)
        mlp = (2 if self.mlp == "gated" else 1) * r * (self.hidden + self.intermediate) + r * (self.intermediate + self.hidden)
        return self.n_layer * (attention + mlp)


@dataclass
class MemoryEstimate:
    """Bytes per component in each phase of one PPO iteration, on one process.

    `rollout` (sampling and the scoring forwards) and `update` (one micro-batch's forward and
    backward, then the optimizer step) each map a component to bytes; `peak` is the larger
    phase's total.
    """

    rollout: dict[str, int] = field(default_factory=dict)
    update: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(sum(self.rollout.values()), sum(self.update.values()))

    @property
    def peak_phase(self) -> str:
        return "rollout" if sum(self.rollout.values()) >= sum(self.update.values()) else "update"

    def rows(self) -> list[tuple[str, float, float]]:
        """(component, rollout MiB, update MiB) for every component, then the totals."""
        names = list(dict.fromkeys([*self.rollout, *self.update]))
        mib = lambda d, k: d.get(k, 0) / 2**20  # noqa: E731
        out = [(k, mib(self.rollout, k), mib(self.update, k)) for k in names]
        return out + [("total", sum(self.rollout.values()) / 2**20, sum(self.update.values()) / 2**20)]


def estimate_memory(
    config,
    policy: ModelShape,
    *,
    prompt_len: int,
    response_len: int | None = None,
    critic: ModelShape | None = None,
    reward: ModelShape | None = None,
    processes: int = 1,
    sharding: str = "none",
) -> MemoryEstimate:
    """Estimate the memory of one PPO iteration on each of `processes` processes.

    Args:
        config: a `PPOConfig` (batch sizes, critic design, precision, LoRA, gradient
            checkpointing, `memory.logprob_chunk`, entropy bonus).
        policy: the policy's shape (the reference has the same).
        prompt_len, response_len: tokens of the longest prompt and response of a batch
            (responses default to `config.sampling.max_new_tokens`).
        critic: a separate critic's shape (default: the policy's); ignored unless
            `config.critic.design == "separate"`.
        reward: a reward model's shape; None for a Python reward function.
        processes: data-parallel processes; each samples and trains its share.
        sharding: what the trained models' state is split over the processes by: "none" (DDP,
            ppo_lab's mode), "zero1" (optimizer state), "zero2" (and gradients), "zero3" (and
            weights with their bf16 copies, frozen models' too; FSDP's full sharding), "fsdp2"
            (ppo_lab's own `memory.sharding: fsdp2`: as "zero3", plus the weights FSDP2 gathers:
            the whole policy while sampling, and a root and two blocks of a model at a time
            otherwise). In this float32 layout the weights are both the working and the master
            copy, so "zero1" shards AdamW's two moments only. ppo_lab runs "none" and "fsdp2";
            the others show what DeepSpeed or another FSDP would save.

    Returns:
        A `MemoryEstimate`. The model: weights in float32 (ppo_lab keeps float32 master
        weights; under bf16 a frozen model's linear weights in bf16, `memory.frozen_weights`;
        autocast keeps a bfloat16 copy of each trained weight for the length of its region, and
        casts a frozen one afresh at each use, so frozen models leave no copies); AdamW's
        two float32 moments and a float32 gradient per trained parameter; per token and block
        the activations in `_MLP_KEPT` / `_BLOCK_KEPT`; logits of the micro-batch held three
        times in the backward pass (the logits, their gradient, the softmax); the KV cache of
        the sampling loop. Scratch memory inside operators is not counted.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding = {sharding!r} is not one of {', '.join(map(repr, SHARDINGS))}")
    if processes < 1 or prompt_len < 1:
        raise ValueError(f"processes ({processes}) and prompt_len ({prompt_len}) must be >= 1")
    cfg = config
    T = cfg.sampling.max_new_tokens if response_len is None else response_len
    L = prompt_len + T
    half = cfg.memory.precision in ("bf16", "fp16")
    act = 2 if half else 4  # bytes of an activation
    lora = cfg.lora.r > 0
    separate = cfg.critic.design == "separate"
    critic = critic or policy
    split = lambda what, level: what // processes if SHARDINGS.index(sharding) >= level else what  # noqa: E731
    fsdp2 = sharding == "fsdp2"
    frozen_bf16 = half and cfg.memory.precision == "bf16" and cfg.memory.frozen_weights in ("auto", "bf16")
    # a frozen model's bytes: in bf16 its linear layers (under fsdp2 all of a wholly frozen one), else float32
    frozen = lambda shape, whole=True: (2 * shape.params if fsdp2 and whole else 4 * shape.params - 2 * shape.linear_params) if frozen_bf16 else 4 * shape.params  # noqa: E731

    weights = {"policy weights": split(frozen(policy, whole=False) if lora else 4 * policy.params, 3)}  # (a LoRA base is frozen)
    if not lora:
        weights["reference weights"] = split(frozen(policy), 3)
    if separate:
        weights["critic weights"] = split(4 * critic.params, 3)
    elif cfg.critic.design == "shared":
        weights["policy weights"] += 4 * (policy.hidden + 1)
    if reward is not None:
        weights["reward model weights"] = split(frozen(reward), 3)
    trained = (policy.lora_params(cfg.lora.r) if lora else policy.params) + (critic.params if separate else (policy.hidden + 1 if cfg.critic.design == "shared" else 0))
    static = {**weights, "optimizer state": split(8 * trained, 1)}

    # rollout: sampling with the KV cache, then a scoring forward per model without gradients
    share = cfg.batch.rollout // processes
    rows = min(cfg.batch.forward or share, share)
    kv = 2 * policy.n_layer * share * L * policy.n_kv_head * policy.head_dim * act
    sampling_logits = 4 * share * policy.vocab * 4  # logits, scaled, softmax, cumulative sum
    transient = rows * L * (_BLOCK_TRANSIENT * policy.hidden + _MLP_TRANSIENT[policy.mlp] * policy.intermediate) * act
    scored = rows * (T + 1) if cfg.memory.logprob_chunk is None else min(cfg.memory.logprob_chunk, rows * (T + 1))
    score_logits = scored * policy.vocab * (act + 4 + (4 if half or cfg.sampling.temperature != 1.0 else 0))
    rollout = {**static, "KV cache": kv, "sampling logits": sampling_logits, "scoring activations": transient, "scoring logits": score_logits}
    rollout["rollout buffers"] = 10 * cfg.batch.rollout * T * 4 + 2 * cfg.batch.rollout * prompt_len * 8
    wd = 2 if half else 4  # FSDP2 gathers a unit in the compute precision while it runs: the root (embeddings, head), a block, the next one
    unit = lambda shape: wd * (shape.root_params + 2 * shape.block_params)  # noqa: E731
    if fsdp2:  # the whole policy gathered for sampling; for scoring, a model's units one at a time (released first)
        rollout["gathered weights"] = max(wd * policy.params, *(unit(s) for s in [policy, critic, *([reward] if reward else [])]))
    elif half:  # autocast caches the bf16 casts of weights that require gradients only (a LoRA adapter's are small)
        rollout["bf16 weight copies"] = split(2 * ((0 if lora else policy.params) + (critic.params if separate else 0)), 3)

    # update: one micro-batch through policy (and separate critic), then backward
    b = cfg.batch.minibatch // (cfg.batch.accumulation_steps * processes)
    if b < 1:
        raise ValueError(
            f"batch.minibatch = {cfg.batch.minibatch} leaves no response for a micro-batch with batch.accumulation_steps = "
            f"{cfg.batch.accumulation_steps} on {processes} processes"
        )
    trained_shapes = [policy, critic] if separate else [policy]
    block = lambda shape: _BLOCK_KEPT * shape.hidden + _MLP_KEPT[shape.mlp] * shape.intermediate  # noqa: E731
    if cfg.memory.gradient_checkpointing:
        # each block keeps its input; the backward recomputes one block at a time, of one model
        # at a time (an upper bound: non-reentrant checkpointing frees each recomputed tensor
        # as soon as the backward has used it)
        units = sum((s.n_layer + _OUTSIDE_BLOCKS) * s.hidden for s in trained_shapes) + max(map(block, trained_shapes))
    else:
        units = sum(s.n_layer * block(s) + _OUTSIDE_BLOCKS * s.hidden for s in trained_shapes)
    activations = b * L * units * act
    positions = b * T if cfg.memory.logprob_chunk is None else min(cfg.memory.logprob_chunk, b * T)
    per_logit = 3 * 4 + (act if half else 0)  # logits (bf16 copy under autocast), their gradient, softmax
    logits = positions * policy.vocab * per_logit * (2 if cfg.loss.entropy_coef > 0 else 1)
    update = {**static, "gradients": split(4 * trained, 2), "activations": activations, "logits": logits}
    update["rollout buffers"] = rollout["rollout buffers"]
    if fsdp2:
        # each trained root stays gathered (its gradient unreduced) from its forward to the end of the backward,
        # which holds a block, the next one gathered ahead, and the block's gradient until its reduce-scatter
        roots, biggest = sum(s.root_params for s in trained_shapes), max(s.block_params for s in trained_shapes)
        update["gathered weights"] = wd * (roots + 2 * biggest)
        update["gathered gradients"] = 0 if lora else wd * (roots + biggest)  # (a LoRA adapter's are small)
    elif half:
        update["bf16 weight copies"] = rollout["bf16 weight copies"]
    return MemoryEstimate(rollout=rollout, update=update)


def measure_iteration(trainer) -> tuple[int, int, object]:
    """Peak tensor bytes of one PPO iteration of `trainer`, measured with `TensorMemory`:
    (rollout peak, update peak, the rollout). Everything the trainer holds counts (its models'
    weights and gradients, the optimizer's state), so the figures compare with
    `estimate_memory`; call it after a first `trainer.iterate()`, once AdamW's moments exist. The
    iteration is a real one: the weights are updated, as by `iterate()` without its metrics."""
    with TensorMemory() as mem:
        mem.hold(trainer.policy, trainer.reference, trainer.critic, trainer.optimizer)
        rollout, _ = trainer.collect()  # (dynamic sampling included, as in `iterate()`)
        rollout_peak = mem.peak
        mem.peak = mem.current
        _, advantages, returns = trainer.advantages(rollout)
        trainer.update(rollout, advantages, returns)
        return rollout_peak, mem.peak, rollout
