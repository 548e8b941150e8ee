"""LoRA through `peft`: a trainable low-rank adapter on a frozen policy, and the reference for free.

Chapter 9 (Scaling up) uses it when the policy is trained with LoRA. Full PPO
keeps two whole language models in memory, the policy and a frozen copy of it as the reference.
With LoRA the policy is W + (alpha / r) B A, where only the small matrices A (r x in) and
B (out x r) are trained and B starts at zero, so at step 0 the policy *is* its base weights. The
reference is then the same weights with the adapter switched off: `LoRAReference` runs the
policy's own model under peft's `disable_adapter()`, and no second copy is ever made.

That equivalence has conditions, and each one is handled here:

1. The base weights must be the starting policy. When the SFT model is itself an adapter (a
   folder with `adapter_config.json`), "adapter off" would mean the model *before* SFT.
   `load_maybe_adapter` merges the SFT adapter into its base (`merge_and_unload`) before the PPO
   adapter is added, so switching the PPO adapter off gives the SFT model back.
2. `modules_to_save` (say, the LM head) trains a full copy of a module; peft keeps the original
   beside it and runs the original while the adapter is off, so the reference stays frozen.
3. Switching off must be undone even when the forward raises, and nesting must be harmless:
   `adapter_disabled` is a context manager over peft's own, which restores the previous state.
4. LoRA dropout (`lora.dropout`) randomises the policy's forward. PPO's first update step
   compares the new log-probs with those of the rollout, so any randomness makes the ratio
   differ from 1 on-policy. The default is 0, and the trainer's `disable_dropout` zeroes it
   anyway, as it does every dropout.
5. Only the adapter (and `modules_to_save` copies) are trainable: `trainable_parameters`.
6. Saving: the adapter alone (megabytes, needs its base to load) or the merged model, a plain
   `AutoModelForCausalLM` folder: `save_lora`.

`peft` is imported inside the functions, so importing `ppo_lab` never needs it.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from .hf import quiet_transformers
from .models import disable_dropout, load_policy, resolve_model_path

ALL_LINEAR = "all-linear"  #: peft's name for every linear layer except the output head

# Warnings peft raises on every GPT-2 and that say nothing actionable here: GPT-2's Conv1D
# layers need fan_in_fan_out (set below, per model); a transformers deprecation inside peft; and,
# when an adapter's base is itself an adapter folder (no config.json to compare vocabularies
# with), the notice that peft assumes the vocabulary unchanged, which holds: PPO never resizes it.
_NOISE = (
    r"fan_in_fan_out is set to",
    r"`is_gradient_checkpointing` is deprecated",
    r"Could not find a config file in .* will assume that the vocabulary was not modified",
)


@contextlib.contextmanager
def _quiet_peft():
    with warnings.catch_warnings():
        for message in _NOISE:
            warnings.filterwarnings("ignore", message=message)
        yield


def _split_names(value, what: str) -> list[str]:
    """Module names from a list or a comma-separated string; a ValueError naming `what` if none."""
    if isinstance(value, str):
        names = [part.strip() for part in value.split(",")]
    elif isinstance(value, Sequence):
        names = [str(part).strip() for part in value]
    else:
        raise ValueError(f"{what} must be module names (a list or a comma-separated string); got {type(value).__name__}")
    names = [n for n in names if n]
    if not names:
        raise ValueError(f"{what} is empty; give module names such as 'c_attn,c_proj'")
    return names


def parse_target_modules(value: str | Sequence[str]) -> str | list[str]:
    """`lora.target_modules` as peft wants it: "all-linear", or a list of module names.

    A comma-separated string ("c_attn, c_proj") becomes a list. This matters: peft reads a plain
    string other than "all-linear" as a regular expression that must match a module's *full*
    name, so "c_attn" alone would match nothing ("transformer.h.0.attn.c_attn").
    """
    if isinstance(value, str) and value.strip().lower() == ALL_LINEAR:
        return ALL_LINEAR
    return _split_names(value, f"target_modules (lora.target_modules: {ALL_LINEAR!r} or module names)")


def _module_names(model: nn.Module, wanted: list[str], what: str, kinds: tuple[type, ...] | None = None) -> None:
    """Raise a ValueError naming `what` if a name in `wanted` matches no module of `model`.

    peft matches a list entry to a module whose full name equals it or ends with "." + it.
    """
    names = [n for n, m in model.named_modules() if n and (kinds is None or isinstance(m, kinds))]
    missing = [w for w in wanted if not any(n == w or n.endswith("." + w) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ValueError(f"{what}: {missing} match no {'linear ' if kinds else ''}module of {type(model).__name__}; available: {leaves}")


def _linear_kinds() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def _tied_embedding_names(model: nn.Module) -> set[str]:
    """Names of the input and output embeddings when they share one weight (GPT-2, Llama-3.2)."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    inp = get_in() if callable(get_in) else None
    out = get_out() if callable(get_out) else None
    if inp is None or out is None or getattr(out, "weight", None) is not getattr(inp, "weight", None):
        return set()
    return {n for n, m in model.named_modules() if m is inp or m is out}


def find_peft_model(model: nn.Module):
    """The `PeftModel` inside `model` (itself, a `PolicyWithValueHead`'s LM, a DDP wrapper's module)."""
    from peft import PeftModel

    for module in model.modules():
        if isinstance(module, PeftModel):
            return module
    raise ValueError(f"{type(model).__name__} has no LoRA adapter (a peft PeftModel); add one with apply_lora first")


def apply_lora(
    model: nn.Module,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: str | Sequence[str] = ALL_LINEAR,
    modules_to_save: str | Sequence[str] | None = None,
):
    """Wrap a causal LM in a trainable LoRA adapter; returns a peft `PeftModelForCausalLM`.

    Args:
        model: an `AutoModelForCausalLM` without adapters (merge an SFT adapter first:
            `load_maybe_adapter`). peft changes it in place: its layers become LoRA layers.
        r: rank of A and B (`lora.r`), a positive integer.
        alpha: scale numerator (`lora.alpha`); the update is (alpha / r) B A.
        dropout: LoRA dropout on the adapter's input (`lora.dropout`), in [0, 1). Keep 0 for
            PPO: dropout makes the rollout and the first update step disagree (ratio != 1).
        target_modules: `lora.target_modules`: "all-linear" (every Linear / Conv1D except the
            output head) or module names, as a list or a comma-separated string.
        modules_to_save: modules trained in full beside the adapter (e.g. "lm_head"); peft keeps
            the original for the adapter-off forward. When the name is one of a pair of tied
            embeddings (GPT-2's wte and lm_head), the pair stays tied, so the merged model keeps
            its architecture. A `PolicyWithValueHead`'s value head needs no entry: it sits
            outside the LM, is trained in full, and the reference never runs it.

    Returns:
        The peft model: the base weights frozen, only the adapter and the `modules_to_save`
        copies trainable. Its forward takes the arguments of the wrapped model's forward.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"r (lora.r) must be a positive integer; got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0 < float(alpha) < float("inf")):
        raise ValueError(f"alpha (lora.alpha) must be a positive finite number; got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (0.0 <= float(dropout) < 1.0):
        raise ValueError(f"dropout (lora.dropout) must be in [0, 1); got {dropout!r}")
    if any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        # A second adapter on top of the first would be switched off with it, and the reference
        # would become the model before SFT: merge the first one into the weights instead.
        raise ValueError(
            f"{type(model).__name__} already carries adapter layers; merge them first "
            "(load_maybe_adapter(path) or peft's merge_and_unload()) so that the reference is the merged model"
        )
    if not hasattr(model, "config"):
        raise ValueError(f"apply_lora needs a transformers causal LM (with a .config); got {type(model).__name__}")

    targets = parse_target_modules(target_modules)
    if targets != ALL_LINEAR:
        _module_names(model, targets, "target_modules (lora.target_modules)", _linear_kinds())
    to_save = None
    if modules_to_save is not None and not (isinstance(modules_to_save, str) and not modules_to_save.strip()):
        to_save = _split_names(modules_to_save, "modules_to_save")
        _module_names(model, to_save, "modules_to_save")
    tied = _tied_embedding_names(model)
    keep_tied = bool(to_save) and any(n == t or n.endswith("." + t) for n in tied for t in to_save)

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=float(dropout),
        target_modules=targets,
        modules_to_save=to_save,
        # GPT-2 stores its linear weights as (in, out) in Conv1D; peft needs to know to transpose.
        fan_in_fan_out=any(isinstance(m, _linear_kinds()[1]) for m in model.modules()),
        bias="none",
        task_type="CAUSAL_LM",
        ensure_weight_tying=keep_tied,
    )
    with _quiet_peft():
        return get_peft_model(model, config)


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) numbers of parameters; each shared tensor is counted once.

    With LoRA the first is a few percent of the second; the optimizer state (two AdamW moments
    per trainable parameter) shrinks by the same factor.
    """
    trainable = total = 0
    for p in model.parameters():  # nn.Module.parameters() yields a tied tensor once
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return trainable, total


@contextlib.contextmanager
def adapter_disabled(model: nn.Module):
    """Within the block, `model` runs its base weights: LoRA layers and modules_to_save copies off.

    `model` is a peft model or anything holding one (`PolicyWithValueHead`, a DDP wrapper).
    peft's `disable_adapter()` restores the state it found on exit, also when the block raises,
    and an inner block inside an outer one leaves the adapter off until the outer one ends.
    peft sets the adapter's `requires_grad` to False while it is off and back to True after.
    """
    with find_peft_model(model).disable_adapter():
        yield model


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """Every submodule in eval mode within the block, each one's own flag restored after.

    `model.train(was_training)` would not do: it would also switch on submodules that had
    been left in eval mode on purpose.
    """
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


class LoRAReference(nn.Module):
    """The reference policy: the LoRA policy's own weights with the adapter switched off.

    A drop-in for `make_reference(policy)`: called like a causal LM (`input_ids`,
    `attention_mask`, `position_ids`, other keyword arguments passed on), it returns the model's
    output with `.logits` (B, L, V), computed under `torch.no_grad()`, in eval mode and with
    the adapter off, so it equals the policy before its first update.

    The policy is deliberately *not* registered as a submodule: the reference owns no
    parameters, so `.parameters()` is empty (nothing is counted, saved or optimised twice), and
    what a caller does to a frozen reference (`.requires_grad_(False)`, `.eval()`, `.to(...)`)
    cannot freeze or switch the policy that shares its weights.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        object.__setattr__(self, "_policy", find_peft_model(policy))

    @property
    def policy(self):
        """The peft model whose base weights this reference runs."""
        return self._policy

    @property
    def config(self):
        return self._policy.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, **kwargs):
        with torch.no_grad(), _eval_mode(self._policy), adapter_disabled(self._policy):
            return self._policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def reference_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, L, V) logits of the reference (the adapter off) for (B, L) `input_ids`, without gradients."""
    return LoRAReference(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits


def _adapter_config_file(path: str) -> str | None:
    """adapter_config.json of `path` (a local folder or a hub name), or None if it is a full model."""
    if os.path.isdir(path):
        found = os.path.join(path, "adapter_config.json")
        return found if os.path.isfile(found) else None
    if os.path.isabs(path) or path.startswith("."):
        return None  # a missing local path: load_policy reports it
    try:
        from transformers.utils.peft_utils import find_adapter_config_file

        return find_adapter_config_file(path)
    except Exception:  # not reachable offline, malformed id...: the full-model loader says why
        return None


def load_maybe_adapter(name: str, trust_remote_code: bool = False) -> nn.Module:
    """The starting policy from `name`: a full causal LM, or an adapter merged into its base.

    `name` is what `load_policy` takes (hub name, local folder, `builtin:tiny`). When it holds
    an adapter (`adapter_config.json`), its base (`base_model_name_or_path`, itself possibly an
    adapter: chains are followed) is loaded, the adapter applied and merged with
    `merge_and_unload`. The result is a plain model whose weights *are* the SFT policy, so a PPO
    adapter added on top and switched off gives the SFT policy back, not the model before SFT.
    Dropout is disabled, as in `load_policy`.

    The merged model's `name_or_path` is set to the adapter's folder, so a PPO adapter saved
    from it records the SFT adapter, not the bare base, as what it must be loaded onto
    (`save_lora`).
    """
    return _load_merged(name, trust_remote_code, ())


def _load_merged(name: str, trust_remote_code: bool, chain: tuple[str, ...]) -> nn.Module:
    path = resolve_model_path(name)
    adapter_config = _adapter_config_file(path)
    if adapter_config is None:
        return load_policy(name, trust_remote_code)
    from peft import PeftConfig, PeftModel

    if os.path.isdir(path):
        path = str(Path(path).resolve())  # recorded below as the base of adapters added on top
    try:
        config = PeftConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"could not read the adapter config of {name!r}: {err}") from err
    if config.is_prompt_learning:
        raise ValueError(f"{name!r} is a {config.peft_type} adapter, which cannot be merged into weights; the starting policy needs a weight adapter such as LoRA")
    base = config.base_model_name_or_path
    if not base:
        raise ValueError(f"the adapter {name!r} does not name its base model (base_model_name_or_path in adapter_config.json)")
    chain = chain + (path,)
    if (str(Path(base).resolve()) if os.path.isdir(base) else base) in chain:
        raise ValueError(f"the adapter {name!r} names itself, directly or through other adapters, as its base model: {list(chain)}")
    model = _load_merged(base, trust_remote_code, chain)
    try:
        with quiet_transformers(), _quiet_peft():
            peft_model = PeftModel.from_pretrained(model, path)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"could not apply the adapter {name!r} to its base {base!r}: {first}") from err
    merged = peft_model.merge_and_unload()
    merged.name_or_path = path
    merged.config.name_or_path = path
    return disable_dropout(merged)


def save_lora(model: nn.Module, folder: str | Path, merged: bool, state_dict: dict | None = None) -> Path:
    """Save the LoRA policy in `folder`; returns the folder.

    merged=False: the adapter only (`adapter_model.safetensors`, `adapter_config.json`: small).
        Its `base_model_name_or_path` is the model the adapter was added to (the SFT adapter's
        folder when the policy started from one), and `load_maybe_adapter(folder)` rebuilds
        the policy.
    merged=True: base + adapter as one plain model, loadable with
        `AutoModelForCausalLM.from_pretrained` and `load_policy`. The merge runs on a temporary
        copy, so the model being trained keeps its adapter (and its frozen base weights exact:
        merging in place and unmerging again would round them). The copy costs one model's
        memory for the duration of the call.

    `model` may be a peft model or hold one (`PolicyWithValueHead`: its value head is not part
    of either folder). Tokenizers are saved by the caller. `state_dict`: the peft model's full
    weights when its own are sharded (`sharding.full_state_dict`; FSDP2 cannot be deep-copied),
    merged on a copy rebuilt from them.
    """
    peft_model = find_peft_model(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with quiet_transformers(), _quiet_peft():
        if merged:
            from .sharding import unsharded_copy

            plain = copy.deepcopy(peft_model) if state_dict is None else unsharded_copy(peft_model, state_dict)
            # a base kept in bf16 (memory.frozen_weights) is merged in the adapter's precision, not rounded again
            plain = plain.to(next(p.dtype for p in peft_model.parameters() if p.requires_grad)).merge_and_unload()
            plain.save_pretrained(folder)
        else:
            if state_dict is not None:
                raise ValueError("save_lora(merged=False) saves the adapter from the model itself; a sharded adapter's is saved merged")
            peft_model.save_pretrained(folder)
    return folder


__all__ = [
    "ALL_LINEAR",
    "LoRAReference",
    "adapter_disabled",
    "apply_lora",
    "find_peft_model",
    "load_maybe_adapter",
    "parse_target_modules",
    "reference_logits",
    "save_lora",
    "trainable_parameters",
]
