"""The four roles of PPO for language models: policy, reference, critic and reward.

Chapter 1 (RL for language models) introduces the roles; chapter 7 (The PPO trainer end to
end) loads them. The policy is any `AutoModelForCausalLM` (a hub name or a local folder); the
reference is a frozen copy of the initial policy; the critic is either a separate model with a
scalar head (initialised from the policy or from a reward model) or a value head on the
policy's own backbone, so that one forward gives both logits and values. The reward is a
callable (see `ppo_lab.rewards`).

Positions. Sequences are the left-padded prompt followed by the response. The logits at
position i predict token i + 1, so the log-prob of response token t comes from the position just
before it, and so does its value: V(s_t) is read from the hidden state of the last token of
s_t, the state in which token t was chosen (as in TRL and OpenRLHF).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn

from .hf import quiet_transformers


def resolve_model_path(name: str) -> str:
    """`builtin:tiny` -> the folder of the offline model (built on first use); else `name`."""
    from .tiny import TINY_MODEL, tiny_model_path

    if name == TINY_MODEL:
        return str(tiny_model_path())
    return name


def split_revision(name: str) -> tuple[str, str | None]:
    """"org/model@rev" -> ("org/model", "rev"): a hub model at a revision (branch, tag or commit;
    N+ publishes its checkpoints on branches). A local path (a `pathlib.Path` too) or a name without "@" is not split."""
    name = os.fspath(name)
    if "@" not in name or name.startswith(("/", ".", "~")) or Path(name).expanduser().exists():
        return name, None
    base, _, revision = name.rpartition("@")
    if not base or not revision:
        raise ValueError(f"model name {name!r}: expected org/model@revision with both parts non-empty")
    return base, revision


def load_pretrained(loader, name: str, role: str, new_weights: bool = False, **kwargs):
    """`loader.from_pretrained(name)`, with errors that name the role and the model.

    A model whose checkpoint lacks some of its weights (a causal LM loaded as a sequence
    classifier gets a freshly initialised score head) is refused, naming them: transformers only
    warns, and a reward or a critic with a random head trains on noise. `new_weights=True` allows
    it where a new head is the point (the base of a reward model about to be trained).
    `name` may carry a hub revision, "org/model@branch" (`split_revision`).
    """
    bare_name, revision = split_revision(name)
    if revision is not None:
        kwargs["revision"] = revision
    path = resolve_model_path(bare_name)
    if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().exists():
        raise ValueError(f"could not load the {role} from {name!r}: no such folder")
    is_model = loader.__name__.startswith("AutoModel")
    try:
        with quiet_transformers():
            if not is_model:
                return loader.from_pretrained(path, **kwargs)
            model, info = loader.from_pretrained(path, output_loading_info=True, **kwargs)
    except Exception as err:  # noqa: BLE001 - every loader fails differently: OSError, ValueError,
        # SafetensorError (a truncated file), RuntimeError (a truncated .bin), the tokenizers
        # library's bare Exception (a truncated tokenizer.json); each becomes one named error
        where = "a local folder" if Path(path).exists() else "not a local folder"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"could not load the {role} from {name!r} ({where}; hub downloads are "
            f"{'off' if _offline() else 'on'}): {first}"
        ) from err
    missing = sorted(set(info.get("missing_keys") or []) | {k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or []})
    if missing and not new_weights:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"the {role} {name!r} has no weights for {shown} in its checkpoint: loaded as "
            f"{loader.__name__} they would be random (is it the right kind of model for this role?)"
        )
    return model


def _offline() -> bool:
    import os

    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def load_tokenizer(name: str, trust_remote_code: bool = False, role: str = "tokenizer"):
    """Load a tokenizer for left-padded batched generation.

    A tokenizer without a pad token (GPT-2, Llama) gets pad = eos. That is safe here because
    response masks come from the first EOS (`ppo_lab.response_mask`), never from comparing
    tokens with the pad id, and prompts carry their own attention mask.
    """
    from transformers import AutoTokenizer

    tok = load_pretrained(AutoTokenizer, name, role, trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer of {name!r} has no EOS token; PPO needs one to end responses (set tokenizer.eos_token)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability to 0.

    With dropout on, the log-probs of the rollout and of the first update step differ, so the
    ratio is not 1 on-policy and the clip fraction measures noise. TRL and verl disable it too.
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def load_policy(name: str, trust_remote_code: bool = False) -> nn.Module:
    """Any `AutoModelForCausalLM` from a hub name, a local folder, or `builtin:tiny`, in float32.

    float32 whatever dtype the checkpoint was saved in: transformers 5 loads a bf16 checkpoint
    (Qwen2.5, Llama 3) in bf16 by default, and AdamW on bf16 weights has no fp32 master copy:
    at a learning rate of 1e-6 most updates are smaller than bf16's rounding step and vanish.
    Mixed precision (`memory.precision`) runs the forwards in bf16 under autocast instead.
    """
    from transformers import AutoModelForCausalLM

    model = load_pretrained(AutoModelForCausalLM, name, "policy model", trust_remote_code=trust_remote_code, dtype=torch.float32)
    return disable_dropout(model)


def to_float32(model: nn.Module, role: str) -> nn.Module:
    """Cast a model passed in by the caller to float32 (in place) if any weight is lower precision.

    The weights that train need a float32 copy for the optimizer to update (see `load_policy`);
    a warning says it happened, since the model's memory doubles.
    """
    if getattr(model, "is_quantized", False):
        return model  # quantized weights (bitsandbytes) cannot be cast; only adapters on them train
    low = sorted({str(p.dtype) for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16)})
    if low:
        import warnings

        warnings.warn(f"the {role} passed in has {', '.join(low)} weights; cast to float32 so that AdamW updates a full-precision copy (memory.precision = 'bf16' runs the forwards in bf16)", stacklevel=3)
        model.float()
    return model


def make_reference(policy: nn.Module) -> nn.Module:
    """A frozen copy of the policy as it is now (call before training starts)."""
    ref = copy.deepcopy(policy)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def context_length(model: nn.Module) -> int | None:
    """The most positions the model accepts, when its config says."""
    cfg = model.config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int):
            return value
    return None


def _hidden_size(config) -> int:
    for attr in ("hidden_size", "n_embd", "d_model", "dim"):
        if isinstance(getattr(config, attr, None), int):
            return getattr(config, attr)
    raise ValueError(f"cannot find the hidden size of {type(config).__name__}")


def new_value_head(hidden: int) -> nn.Linear:
    """A scalar head starting at V = 0 everywhere (the weights learn fast; zero avoids a
    large random initial value error that would dominate the first updates)."""
    head = nn.Linear(hidden, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class PolicyWithValueHead(nn.Module):
    """A causal LM plus a scalar head on its last hidden state: one forward, logits and values."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.v_head = new_value_head(_hidden_size(lm.config))
        from .rollout import supports_logits_to_keep

        self.accepts_logits_to_keep = supports_logits_to_keep(lm)

    def forward(self, input_ids, attention_mask, position_ids, **kwargs):
        """(logits, values): values for every position; `logits_to_keep` (if given) trims the logits only."""
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, output_hidden_states=True, **kwargs)
        values = self.v_head(out.hidden_states[-1].to(self.v_head.weight.dtype)).squeeze(-1)  # (B, L)
        return out.logits, values


def causal_mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """At each position t, the mean of the hidden states of the real tokens at positions <= t.

    Args:
        hidden: (B, L, H) hidden states; attention_mask: (B, L) 1 on real tokens (left padding 0).

    Returns:
        (B, L, H); a position with no real token up to it (left padding) gets zeros.
    """
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, L, 1)
    return (hidden * m).cumsum(dim=1) / m.cumsum(dim=1).clamp(min=1.0)


class Critic(nn.Module):
    """A transformer backbone with a scalar head: V(s) for every position.

    `pooling="token"` reads the hidden state at position t (the usual critic); `"mean"` reads
    the mean of the hidden states up to t (`causal_mean_pool`), a smoother summary of the
    sequence so far (chapter 7 compares them).
    """

    def __init__(self, backbone: nn.Module, head: nn.Linear, pooling: str = "token"):
        super().__init__()
        if pooling not in ("token", "mean"):
            raise ValueError(f"unknown value pooling {pooling!r}; valid values are: 'token', 'mean'")
        self.backbone = backbone
        self.head = head
        self.pooling = pooling
        import inspect

        # a decoder backbone would build a KV cache for the whole sequence, used by nothing
        takes = "use_cache" in inspect.signature(backbone.forward).parameters
        self._no_cache = {"use_cache": False} if takes else {}

    def forward(self, input_ids, attention_mask, position_ids):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **self._no_cache).last_hidden_state
        if self.pooling == "mean":
            hidden = causal_mean_pool(hidden, attention_mask)
        # (B, L); a new tensor, not a view of the head's output: FSDP2 warns of views, whose
        # in-place changes would skip its backward hook
        return torch.flatten(self.head(hidden.to(self.head.weight.dtype)), start_dim=1).clone()


def load_critic(name: str, trust_remote_code: bool = False, pooling: str = "token") -> Critic:
    """A separate critic from a causal LM (new head) or a 1-label sequence classifier (its head),
    in float32 whatever the checkpoint's dtype (it trains; see `load_policy`).

    Initialising from the reward model, as TRL and DeepSpeed-Chat do, starts the critic with a
    backbone that already tells good responses from bad ones.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    config = load_pretrained(AutoConfig, name, "critic config", trust_remote_code=trust_remote_code)
    archs = getattr(config, "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in archs) and config.num_labels == 1:
        clf = load_pretrained(AutoModelForSequenceClassification, name, "critic model", trust_remote_code=trust_remote_code, dtype=torch.float32)
        head = getattr(clf, "score", None) or getattr(clf, "classifier", None)
        if isinstance(head, nn.Linear) and head.out_features == 1:
            return Critic(disable_dropout(clf.base_model), head, pooling)
    backbone = load_pretrained(AutoModel, name, "critic model", trust_remote_code=trust_remote_code, dtype=torch.float32)
    return Critic(disable_dropout(backbone), new_value_head(_hidden_size(backbone.config)), pooling)


def enable_checkpointing(model) -> None:
    """Turn on activation (gradient) checkpointing in a transformers model, non-reentrant:
    that variant works with frozen inputs (LoRA) and is inactive in no-grad generation."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
