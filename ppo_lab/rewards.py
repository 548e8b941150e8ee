"""Rewards as callables: `(prompts: list[str], responses: list[str]) -> scores`.

Chapter 7 (The PPO trainer end to end) and chapter 8 (Reward models) use them. Any Python
function of the texts is a reward, so a rule, a lexicon (VADER) or a reward model with a
different tokenizer from the policy's all plug in the same way; a sequence-classification model
is wrapped by `SequenceClassifierReward`. The trainer checks what comes back with
`check_scores`: one finite number per response, or a ValueError that says what was wrong.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch

RewardFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]


def check_scores(scores, n: int, source: str = "the reward function", finite: bool = True) -> torch.Tensor:
    """(n,) float32 tensor of `scores`, or a ValueError naming `source` and the problem.

    With `finite=False` nan and inf pass through (the trainer skips such an update itself and
    stops after `max_bad_updates`); a wrong type or shape is always an error.
    """
    try:
        tensor = torch.as_tensor(scores if isinstance(scores, torch.Tensor) else list(scores), dtype=torch.float32)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source} must return one number per response; got {type(scores).__name__} ({err})") from None
    tensor = tensor.detach().cpu()
    if tensor.dim() == 2 and tensor.shape[1] == 1:
        tensor = tensor.squeeze(1)
    if tensor.dim() != 1 or tensor.shape[0] != n:
        raise ValueError(f"{source} returned scores of shape {tuple(tensor.shape)} for {n} responses; expected ({n},)")
    bad = ~torch.isfinite(tensor)
    if finite and bool(bad.any()):
        rows = torch.nonzero(bad).flatten()[:5].tolist()
        raise ValueError(f"{source} returned nan or inf for response(s) {rows}: {tensor[bad][:5].tolist()}")
    return tensor


class SequenceClassifierReward:
    """A sequence-classification model as a reward, with its own tokenizer.

    The score of a response is the logit of label `label_index` (the only one for a 1-label
    reward model, the "positive" one for a sentiment classifier) on the text prompt + response.
    """

    def __init__(self, name: str, label_index: int = -1, device: str | torch.device = "cpu", batch_size: int = 64, trust_remote_code: bool = False):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from .models import disable_dropout, load_pretrained

        self.tokenizer = load_pretrained(AutoTokenizer, name, "reward tokenizer", trust_remote_code=trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.model = load_pretrained(AutoModelForSequenceClassification, name, "reward model", trust_remote_code=trust_remote_code)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        disable_dropout(self.model).eval().requires_grad_(False).to(device)
        self.label_index, self.device, self.batch_size = label_index, device, batch_size

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        texts = [p + (r if r[:1].isspace() else " " + r) for p, r in zip(prompts, responses)]
        out = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i : i + self.batch_size], return_tensors="pt", padding=True).to(self.device)
            out.append(self.model(**enc).logits[:, self.label_index].float().cpu())
        return torch.cat(out)


def load_reward(spec: str | None, task=None, label_index: int = -1, device="cpu", trust_remote_code: bool = False) -> RewardFn:
    """None -> the task's gold reward; "module:function" -> that callable; else a model."""
    if spec is None:
        if task is None:
            raise ValueError("no reward given and no task to take one from")
        return task.reward
    if ":" in spec and not spec.startswith("builtin:"):
        module, _, attr = spec.partition(":")
        import os
        import sys

        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.append(os.getcwd())  # `ppo-lab train --reward my_rewards:score` from the folder holding my_rewards.py
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"reward {spec!r}: cannot import {attr!r} from module {module!r} ({err})") from None
        if not callable(fn):
            raise ValueError(f"reward {spec!r} is not callable")
        return fn
    return SequenceClassifierReward(spec, label_index, device, trust_remote_code=trust_remote_code)
