"""Everything a run is made of, built from a `PPOConfig` (chapter 7): the accelerator, the prompts and the
reward, the four models (policy, reference, critic, reward), the optimizer and its schedule,
and the KL controllers. `PPOTrainer.__init__` makes these calls in order, then builds the objects
its loop calls (`Objective`, `Sampler`, `OptimizerStep`, ...) from the same config.
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass

import torch

from .checkpoint import from_json, to_json
from .config import PPOConfig
from .decoding import resolve_decode
from .kl_control import AdaptiveKLController, FixedKLController, PPOPenaltyKLController
from .models import PolicyWithValueHead, context_length, disable_dropout, enable_checkpointing, load_critic, load_tokenizer, make_reference, to_float32
from .sampling import Sampling

# torch.compile's backend for `memory.compile` (the tests switch to "eager", which traces
# the same graphs in seconds instead of minutes on a CPU).
COMPILE_BACKEND = "inductor"


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (model initialisation uses them)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# Fixed stream numbers (not hash(), which changes between processes) for `draws`.
STREAMS = {"sample": 1, "shuffle": 2, "eval": 3, "reference": 4, "sampler": 5}


def draws(seed: int, iteration: int | None, stream: str, attempt: int = 0) -> torch.Generator:
    """A CPU generator for one purpose ("sample", "shuffle", "eval", "reference", "sampler") of one
    iteration, the same on every process and in a resumed run. (Evaluation and the reference
    responses of `reward.reference_norm` pass iteration None: the same draws every time.) `attempt`
    numbers the extra rollouts of one iteration (dynamic sampling); 0 is the usual one."""
    if iteration is None:
        return torch.Generator().manual_seed(seed * 8 + STREAMS[stream])
    return torch.Generator().manual_seed((seed * 1_000_003 + iteration) * 8 + STREAMS[stream] + attempt * (1 << 48))


def make_accelerator(cfg: PPOConfig):
    """An `accelerate.Accelerator` for the config's precision, trackers and compilation."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if cfg.memory.precision == "fp16" and not torch.cuda.is_available():
        raise ValueError("memory.precision = 'fp16' needs a CUDA GPU; use 'fp32' or 'bf16' on the CPU")
    set_cuda_allocator(cfg.memory.cuda_allocator)
    # accelerate keeps one global state per process; a second trainer in the same notebook
    # with another precision would be refused. The process group (PartialState) is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision="no" if cfg.memory.precision == "fp32" else cfg.memory.precision,
        log_with=[t.strip() for t in cfg.run.report_to.split(",")] if cfg.run.report_to else None,
        project_dir=cfg.run.output_dir,
        dynamo_backend=COMPILE_BACKEND if cfg.memory.compile else "no",
    )


ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")  # the names torch reads


def set_cuda_allocator(kind: str) -> bool:
    """Turn on the CUDA caching allocator's expandable segments for `kind` = "expandable"; True if it did.

    Without them, memory freed between the rollout and the update stays reserved in blocks of the
    wrong sizes, and the reserved peak (what runs out) was 1.41x TRL's on the GPU benchmark
    (33.1 GiB against 23.5), for an allocated peak of 0.84x; with them it was 16.0 GiB, against
    35.1 GiB in the run just before it on the same machine
    (`benchmarks/results/gpu-20261124-090633-expandable-segments.md`). The setting is the
    process's, so an allocator setting the user made (`ALLOC_CONF_VARIABLES`) is left alone, and
    nothing happens without CUDA. Segments made before the call keep their kind. Its speed cost,
    if any, is not settled: the one run with it (2 updates) was 9% slower than the run before.
    """
    if kind != "expandable" or not torch.cuda.is_available() or any(os.environ.get(v) for v in ALLOC_CONF_VARIABLES):
        return False
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return True


@dataclass
class TaskSetup:
    """The prompts and the reward of a run."""

    builtin: object  # the built-in task they come from (ppo_lab.tasks), or None
    train_prompts: list[str]
    eval_prompts: list[str]
    reward_fn: object  # (prompts, responses) -> scores
    reward_name: str  # for error messages: module.function, or the class


def build_task(cfg: PPOConfig, device, train_prompts=None, eval_prompts=None, reward_fn=None) -> TaskSetup:
    """What is passed in, else the config's built-in task and reward."""
    from .rewards import load_reward

    task = None
    if train_prompts is not None and cfg.data.prompts_file is not None:
        raise ValueError(f"training prompts were passed in and data.prompts_file = {cfg.data.prompts_file!r} names others; give one of them")
    if train_prompts is None and cfg.data.prompts_file is not None:
        train_prompts = read_prompts(cfg.data.prompts_file, cfg.data.prompt_field)
        if eval_prompts is None:
            eval_prompts = read_prompts(cfg.data.eval_prompts_file, cfg.data.prompt_field) if cfg.data.eval_prompts_file else train_prompts
    elif eval_prompts is None and cfg.data.eval_prompts_file is not None:
        eval_prompts = read_prompts(cfg.data.eval_prompts_file, cfg.data.prompt_field)
    if train_prompts is None or (reward_fn is None and cfg.reward.source is None):
        from .tasks import get_task

        task = get_task(cfg.data.task)
    for name, given in (("train_prompts", train_prompts), ("eval_prompts", eval_prompts)):
        if isinstance(given, (str, bytes)):  # list("the food was") would train on its characters
            raise ValueError(f"{name} is one string ({given[:40]!r}); give a list of prompts, e.g. [{given[:40]!r}]")
    if reward_fn is not None and not callable(reward_fn):
        raise ValueError(f"reward_fn = {reward_fn!r} is not callable: give a function of (prompts, responses) returning one score per response")
    train = list(train_prompts if train_prompts is not None else task.train_prompts)
    evaluation = list(eval_prompts if eval_prompts is not None else (task.eval_prompts if task else train))
    if not train:
        raise ValueError("the prompt set is empty: give at least one training prompt")
    if not evaluation:
        raise ValueError("eval_prompts is empty: give at least one evaluation prompt, or leave it out to evaluate on the task's (or the training) prompts")
    for name, prompts in (("training", train), ("evaluation", evaluation)):
        bad = next((i for i, p in enumerate(prompts) if not (isinstance(p, str) and p)), None)
        if bad is not None:
            raise ValueError(f"{name} prompt {bad} is {prompts[bad]!r}: every prompt must be a non-empty string")
    reward_fn = reward_fn or load_reward(cfg.reward.source, task, cfg.reward.label_index, device, cfg.policy.trust_remote_code)
    name = getattr(reward_fn, "__qualname__", type(reward_fn).__name__)
    module = getattr(reward_fn, "__module__", None)
    shown = f"{module}.{name}" if module and module not in ("__main__", "builtins") and not module.startswith("ppo_lab") else name
    return TaskSetup(task, train, evaluation, reward_fn, shown)


def read_prompts(path: str, field: str = "prompt") -> list[str]:
    """The prompts in a file: .jsonl or .json (JSON lines, as `datasets`' `to_json` writes), one
    JSON object per line with the prompt under `field`, or a .json file holding one JSON array of
    such objects or of strings; any other suffix, one prompt per line. Blank lines are skipped.
    Errors name the file and line (or array item)."""
    import json
    from pathlib import Path

    file = Path(path)
    if file.is_dir():
        raise ValueError(f"prompts file {path!r} is a folder; name a file (.jsonl, .json, or text with one prompt per line)")
    if not file.is_file():
        raise ValueError(f"prompts file {path!r} does not exist")
    try:
        text = file.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"prompts file {path!r} cannot be read as UTF-8 text: {err}") from None
    suffix = file.suffix.lower()
    if suffix == ".json" and text.lstrip().startswith("["):  # one JSON array, not JSON lines
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"prompts file {path!r}: not a valid JSON array ({err.msg} at line {err.lineno})") from None
        rows = [(f"item {i}", item) for i, item in enumerate(items)]
    else:
        rows = []
        for number, line in enumerate(text.split("\n"), 1):
            line = line.rstrip("\r")
            if not line.strip():
                continue
            if suffix not in (".jsonl", ".json"):
                rows.append((f"line {number}", line))
                continue
            try:
                rows.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"prompts file {path!r}, line {number}: not valid JSON ({err.msg})") from None
    prompts = []
    for where, row in rows:
        if isinstance(row, str) and row:
            prompts.append(row)
            continue
        if not isinstance(row, dict):
            kind = {list: "array", bool: "boolean", int: "number", float: "number", str: "string"}.get(type(row), "null")
            raise ValueError(f"prompts file {path!r}, {where}: a JSON {kind}, not an object with the prompt under {field!r}")
        if field not in row:
            keys = ", ".join(map(repr, row)) or "no keys"
            raise ValueError(f"prompts file {path!r}, {where}: no {field!r} (has {keys}); set data.prompt_field to the key that holds the prompt")
        if not isinstance(row[field], str) or not row[field]:
            raise ValueError(f"prompts file {path!r}, {where}: {field!r} holds {row[field]!r}, not a non-empty string")
        prompts.append(row[field])
    if not prompts:
        raise ValueError(f"prompts file {path!r} holds no prompt")
    return prompts


class PromptStream:
    """`per_iteration` prompts at a time, in an order reshuffled at every pass over the set."""

    def __init__(self, prompts: list[str], per_iteration: int, seed: int):
        self.prompts, self.per_iteration = prompts, per_iteration
        self.order: list[int] = []
        self.rng = random.Random(seed)

    def next(self) -> list[str]:
        out = []
        while len(out) < self.per_iteration:
            if not self.order:
                self.order = list(range(len(self.prompts)))
                self.rng.shuffle(self.order)
            out.append(self.prompts[self.order.pop()])
        return out

    def state_dict(self) -> dict:
        return {"order": list(self.order), "rng": to_json(self.rng.getstate())}

    def load_state_dict(self, state: dict) -> None:
        self.order = list(state["order"])
        self.rng.setstate(from_json(state["rng"]))


@dataclass
class Roles:
    """The models of a run (before `accelerator.prepare`)."""

    tokenizer: object
    policy: torch.nn.Module  # the LM, or a PolicyWithValueHead around it (critic = "shared")
    reference: torch.nn.Module
    critic: torch.nn.Module | None  # a separate critic
    sampling: Sampling


def build_roles(cfg: PPOConfig, task: TaskSetup, device, policy=None, tokenizer=None) -> Roles:
    """Tokenizer, policy, reference and critic; dropout off everywhere, so that the first update
    step is exactly on-policy (ratio 1)."""
    role = "tokenizer (policy.tokenizer)" if cfg.policy.tokenizer else "tokenizer of policy.model"
    tokenizer = tokenizer or load_tokenizer(cfg.policy.tokenizer or cfg.policy.model, cfg.policy.trust_remote_code, role)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if policy is None:
        from .lora import load_maybe_adapter

        # an SFT model saved as a LoRA adapter is merged into its base first, so that the
        # reference (and a PPO adapter switched off) is the SFT policy, not the base model
        policy = load_maybe_adapter(cfg.policy.model, cfg.policy.trust_remote_code)
    else:
        policy = to_float32(policy, "policy")
    lm = disable_dropout(policy)  # a model passed in keeps the dropout it was built with
    stop_ids = [tokenizer.eos_token_id]
    if cfg.sampling.stop_token is not None:
        stop = tokenizer.convert_tokens_to_ids(cfg.sampling.stop_token)
        if stop is None or stop == tokenizer.unk_token_id:
            raise ValueError(f"sampling.stop_token = {cfg.sampling.stop_token!r} is not a token of the tokenizer")
        stop_ids.append(stop)
    check_prompt_lengths(tokenizer, lm, task.train_prompts, cfg.sampling.max_new_tokens, "training prompt")
    if task.eval_prompts != task.train_prompts:
        check_prompt_lengths(tokenizer, lm, task.eval_prompts, cfg.sampling.max_new_tokens, "eval prompt")
    if cfg.lora.r > 0:
        from .lora import LoRAReference, apply_lora

        # LoRA's dropout modules are new: switched off like every other dropout
        lm = disable_dropout(apply_lora(lm, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules))
        reference = LoRAReference(lm)  # the adapter switched off: no second copy of the weights
    else:
        reference = make_reference(lm).to(device)
    critic = None
    if cfg.critic.design == "separate":
        critic = load_critic(cfg.critic.model or cfg.policy.model, cfg.policy.trust_remote_code, pooling=cfg.critic.pooling)
    if cfg.memory.gradient_checkpointing:
        for model in (lm, critic.backbone if critic is not None else None):
            if model is not None:
                enable_checkpointing(model)
    # "auto" is settled here, once, and the run's sampling settings hold the decoder it chose
    decode, _ = resolve_decode(cfg.sampling.decode, lm, device)
    decode = "dynamic" if decode == "cuda_graph" and cfg.memory.sharding != "none" else decode  # (FSDP2's root forward waits on its own streams: not capturable)
    sampling = dataclasses.replace(cfg.sampling, stop_ids=() if cfg.sampling.ignore_eos else stop_ids, decode=decode)
    return Roles(tokenizer, PolicyWithValueHead(lm) if cfg.critic.design == "shared" else lm, reference, critic, sampling)


def check_prompt_lengths(tokenizer, lm, prompts: list[str], max_new_tokens: int, what: str = "prompt") -> None:
    """Every prompt, plus the longest response, fits the model's context; an error names the
    prompt as `what` and its index in its own list."""
    limit = context_length(lm)
    if limit is None:
        return
    for i, ids in enumerate(tokenizer(prompts, add_special_tokens=False)["input_ids"]):
        if len(ids) + max_new_tokens > limit:
            raise ValueError(
                f"{what} {i} has {len(ids)} tokens; with max_new_tokens = {max_new_tokens} that is "
                f"{len(ids) + max_new_tokens} positions, more than the model's context of {limit}"
            )
        if not ids:
            raise ValueError(f"{what} {i} is empty after tokenization")


def build_optimizer(cfg: PPOConfig, policy, critic):
    """AdamW over every trainable weight (the critic's in a group with its own learning rate
    when `critic.lr` is set), and the learning-rate schedule, stepped once per
    optimizer step."""
    from transformers import get_scheduler

    value_head = policy.v_head if isinstance(policy, PolicyWithValueHead) else None
    head_ids = {id(p) for p in value_head.parameters()} if value_head is not None else set()
    policy_params = [p for p in policy.parameters() if p.requires_grad and id(p) not in head_ids]
    critic_params = [p for p in (critic or value_head or torch.nn.Module()).parameters() if p.requires_grad]
    groups = [{"params": policy_params, "name": "policy"}]  # (the names pick the groups for per-model clipping)
    if critic_params:
        groups.append({"params": critic_params, "lr": cfg.critic.lr or cfg.optim.lr, "name": "critic"})
    # The fused kernel updates all tensors in one pass: on a CPU a third of the time of the
    # default one-tensor-at-a-time loop (benchmarks/results/hotspots-*.json).
    params = policy_params + critic_params
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64) for p in params)
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, eps=cfg.optim.adam_eps, weight_decay=cfg.optim.weight_decay, **({"fused": True} if fused else {}))
    steps_per_iteration = cfg.batch.epochs * (cfg.batch.rollout // cfg.batch.minibatch)
    # Not passed to accelerator.prepare: its scheduler wrapper steps once per process.
    scheduler = get_scheduler(
        {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.optim.schedule],
        optimizer,
        num_warmup_steps=cfg.optim.warmup_steps,
        num_training_steps=cfg.run.iterations * steps_per_iteration,
    )
    return optimizer, scheduler


def build_kl_controllers(cfg: PPOConfig):
    """The reference-KL coefficient's controller, and PPO-penalty's (KL to the *old* policy;
    None unless loss.policy = "ppo_penalty")."""
    if cfg.kl.control == "adaptive":
        kl_ctl = AdaptiveKLController(cfg.kl.coef, cfg.kl.target, cfg.kl.horizon)
    else:
        kl_ctl = FixedKLController(cfg.kl.coef)
    penalty_ctl = PPOPenaltyKLController(cfg.loss.penalty_beta, cfg.loss.penalty_target) if cfg.loss.policy == "ppo_penalty" else None
    return kl_ctl, penalty_ctl
