"""Rewards as callables: `(prompts: list[str], responses: list[str]) -> scores`.

Chapter 7 (The PPO trainer end to end) and chapter 8 (Reward models) use them. Any Python
function of the texts is a reward, so a rule, a lexicon (VADER) or a reward model with a
different tokenizer from the policy's all plug in the same way; a sequence-classification model
is wrapped by `SequenceClassifierReward`. The trainer checks what comes back with
`check_scores`: one finite number per response, or a ValueError that says what was wrong.

Where a decoder reward model (a `score` head on a backbone: GPT-2, Llama, Qwen, Pythia) reads
its score, decided on purpose: at the LAST REAL TOKEN, found from the attention mask
(`sequence_scores`), and a response that ended carries the reward tokenizer's EOS there. A
reward model trained to score at the EOS (N+, and `ppo_lab.train_reward_model`) is therefore
read at the token it was trained on. Transformers' own pooling finds the last token that is not
the pad id, which lands one token early when pad == eos (GPT-2, Pythia, Llama), so it is not
used. When the reward model shares the policy's tokenizer, the trainer passes the token ids as
sampled (`SequenceClassifierReward.score_ids`: no decode and re-tokenise; the EOS is appended to
a response that ended on another stop token, and the tokenizer's BOS, if it adds one, is put
in front, as in training); with another tokenizer the text goes through, with that tokenizer's
EOS appended to the responses that ended. An encoder (BERT-like) pools at its first token by
its own rule and gets the text without an EOS. A Python reward that takes an `ended` keyword
receives the same information (a list of bools: whether each response ended with a stop token
rather than running out of tokens).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence

import torch

RewardFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]  # (prompts, responses[, ended=]) -> scores


def check_scores(scores, n: int, source: str = "the reward function", finite: bool = True) -> torch.Tensor:
    """(n,) float32 tensor of `scores`, or a ValueError naming `source` and the problem.

    With `finite=False` nan and inf pass through (the trainer skips such an update itself and
    stops after `run.max_bad_updates`); a wrong type or shape is always an error.
    """
    try:
        tensor = torch.as_tensor(scores if isinstance(scores, torch.Tensor) else list(scores), dtype=torch.float32)
    except (TypeError, ValueError) as err:
        # name what came back (torch's own words, "too many dimensions 'str'", say it only indirectly)
        items = list(scores) if isinstance(scores, (list, tuple)) else []
        odd = next((x for x in items if not isinstance(x, (int, float)) or isinstance(x, bool)), None)
        what = f"a {type(scores).__name__} holding {type(odd).__name__} values such as {odd!r}" if odd is not None else f"{type(scores).__name__} ({err})"
        raise ValueError(f"{source} must return one number per response; got {what}") from None
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


class GoldReward:
    """A second reward, measured and never trained on (chapter 8): `fn(prompts, responses) ->
    scores`, or None for none. With a learned reward model as the trained reward and the reward
    its preference labels came from as the gold one, a run shows over-optimisation: the trained
    score rising while the gold one falls. The trainer calls it unconditionally; without a gold
    reward it measures nothing."""

    def __init__(self, fn: RewardFn | None = None):
        if fn is not None and not callable(fn):
            raise TypeError(f"gold_fn must be a callable (prompts, responses) -> scores, got {type(fn).__name__}")
        self.fn = fn

    def scores(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        """(B,) the gold scores of these responses, checked (finite)."""
        return check_scores(self.fn(prompts, responses), len(prompts), "gold_fn")

    def rollout_metrics(self, prompts: Sequence[str], responses: Sequence[str], mean_over_processes) -> dict[str, float]:
        """{"reward/gold_mean": the mean gold score of every process's responses} (equal shares per
        process; `mean_over_processes` averages a 0-dim tensor over them), or {} without a gold reward."""
        if self.fn is None:
            return {}
        return {"reward/gold_mean": mean_over_processes(self.scores(prompts, responses).double().mean()).item()}

    def annotate(self, samples: list[dict], prompts: Sequence[str], responses: Sequence[str]) -> list[dict]:
        """`samples` (one dict per response), each with its "gold" score added when there is a gold reward."""
        if self.fn is not None:
            for sample, gold in zip(samples, self.scores(prompts, responses).tolist()):
                sample["gold"] = gold
        return samples


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, label_index: int = -1) -> torch.Tensor:
    """(N,) float32 scores of a sequence-classification model, read at each row's last real token.

    Args:
        model: an `AutoModelForSequenceClassification`. A decoder (it has a `score` head on its
            backbone: GPT-2, Llama, Qwen, Pythia) is read at the last position where
            `attention_mask` is 1; any other model (an encoder such as BERT pools at its first
            token) gets the same compacted rows and pools by its own rule.
        input_ids, attention_mask: (N, L), padded on either side or both (a left-padded prompt
            followed by a right-padded response): the real tokens are moved to the front of
            each row, in order, before the forward, so absolute position embeddings see 0, 1, ...
        label_index: which logit is the score.

    For a decoder the pad id is never compared with anything, so pad == eos cannot move the
    reading position.
    """
    real = attention_mask.long()
    empty = torch.nonzero(real.sum(dim=1) == 0).flatten().tolist()
    if empty:
        raise ValueError(f"sequence(s) {empty[:5]} to score have no real token (their attention mask is all zero)")
    order = torch.sort(1 - real, dim=1, stable=True).indices  # real tokens first, in their order
    ids, att = input_ids.gather(1, order), real.gather(1, order)
    if not reads_at_a_token(model):
        return model(input_ids=ids, attention_mask=att).logits[:, label_index].float()
    head, backbone = model.score, getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=ids, attention_mask=att)[0]  # (N, L, H)
    last = att.sum(dim=1) - 1
    read = hidden[torch.arange(len(ids), device=ids.device), last]  # (N, H)
    with torch.autocast(read.device.type, enabled=False):  # the head in its own precision: under a bf16 autocast the
        return head(read.to(head.weight.dtype))[:, label_index].float()  # scores would be rounded to bf16 (ties in a group)


def special_prefix(tokenizer) -> list[int]:
    """The ids `tokenizer` puts in front of every text (a BOS for Llama-style tokenizers; none
    for GPT-2's or Pythia's)."""
    with_special, without = tokenizer("a")["input_ids"], tokenizer("a", add_special_tokens=False)["input_ids"]
    n = len(with_special) - len(without)
    return list(with_special[:n]) if n > 0 and with_special[n : n + len(without)] == without else []


def reads_at_a_token(model) -> bool:
    """Whether `model` is a decoder reward model: a `score` head on its backbone."""
    return hasattr(model, "score") and hasattr(model, getattr(model, "base_model_prefix", "") or "_no_backbone_")


class SequenceClassifierReward:
    """A sequence-classification model as a reward, with its own tokenizer.

    The score of a response is the logit of label `label_index` (the only one for a 1-label
    reward model, the "positive" one for a sentiment classifier) on prompt + response, read at
    the last real token (`sequence_scores`), then mapped by the `reward_gain` and `reward_bias`
    stored in the model's config, if any (`train_reward_model` writes them).
    """

    def __init__(self, name: str, label_index: int = -1, device: str | torch.device = "cpu", batch_size: int = 64, trust_remote_code: bool = False):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from .models import disable_dropout, load_pretrained

        self.tokenizer = load_pretrained(AutoTokenizer, name, "reward tokenizer", trust_remote_code=trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_pretrained(AutoModelForSequenceClassification, name, "reward model", trust_remote_code=trust_remote_code)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        disable_dropout(self.model).eval().requires_grad_(False).to(device)
        labels = int(getattr(self.model.config, "num_labels", 1))
        if not -labels <= label_index < labels:  # found here, not as an IndexError at the first rollout
            raise ValueError(f"reward.label_index = {label_index}, but the reward model {name!r} has {labels} label{'s' if labels != 1 else ''} (valid: {-labels} to {labels - 1})")
        self.label_index, self.device, self.batch_size = label_index, device, batch_size
        self.gain = float(getattr(self.model.config, "reward_gain", 1.0))
        self.bias = float(getattr(self.model.config, "reward_bias", 0.0))
        # a decoder reads its score at a token; an encoder pools at its first token and has no use for an EOS
        self.appends_eos = reads_at_a_token(self.model) and self.tokenizer.eos_token_id is not None
        # what the tokenizer puts in front of a text (a BOS for Llama-style tokenizers), which the
        # sampled ids lack (prompts are tokenized without special tokens for generation)
        self.prefix = special_prefix(self.tokenizer)

    def _scores(self, ids: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        out = [sequence_scores(self.model, ids[i : i + self.batch_size], att[i : i + self.batch_size], self.label_index) for i in range(0, len(ids), self.batch_size)]
        return (torch.cat(out) * self.gain + self.bias).cpu()

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], responses: Sequence[str], ended: Sequence[bool] | None = None) -> torch.Tensor:
        """Scores of the texts prompt + response; `ended[i]` appends this tokenizer's EOS to response i."""
        ids, att = encode_pairs(self.tokenizer, prompts, responses, ended if self.appends_eos else None)
        return self._scores(ids.to(self.device), att.to(self.device))

    @torch.no_grad()
    def score_ids(self, query_ids: torch.Tensor, query_mask: torch.Tensor, response_ids: torch.Tensor, mask: torch.Tensor, ended: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of the token ids as sampled (a shared tokenizer): (B, P) left-padded prompts,
        (B, T) responses with their mask, the stop token included, and (B,) `ended`. A response
        that ended on a stop token other than EOS gets the EOS appended, and the tokenizer's
        prefix (BOS) goes in front, so the ids are those `encode_pairs` gives in training; each
        is read at its last real token, the EOS of one that ended."""
        b = query_ids.shape[0]
        ids = torch.cat([query_ids, response_ids], dim=1).to(self.device)
        att = torch.cat([query_mask.long(), mask.long()], dim=1).to(self.device)
        if self.prefix:
            ids = torch.cat([torch.tensor([self.prefix] * b, dtype=torch.long, device=self.device), ids], dim=1)
            att = torch.cat([torch.ones(b, len(self.prefix), dtype=torch.long, device=self.device), att], dim=1)
        if ended is not None and self.appends_eos:
            eos = self.tokenizer.eos_token_id
            last = response_ids.gather(1, (mask.sum(dim=1).long() - 1).clamp(min=0)[:, None]).squeeze(1)
            add = (ended.bool() & (last != eos)).long().to(self.device)[:, None]
            ids = torch.cat([ids, torch.full_like(add, eos)], dim=1)  # (compacted after the last real token)
            att = torch.cat([att, add], dim=1)
        return self._scores(ids, att)

    def shares_tokenizer(self, tokenizer) -> bool:
        """Whether `tokenizer` maps text to the same ids as this reward model's tokenizer."""
        mine = self.tokenizer
        return mine.eos_token_id == tokenizer.eos_token_id and mine.get_vocab() == tokenizer.get_vocab()


def encode_pairs(tokenizer, prompts: Sequence[str], responses: Sequence[str], ended: Sequence[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (N, L) and right-padded, of the texts prompt + " " +
    response (no space added when the response starts with one), with `tokenizer`'s EOS id
    appended to every response whose `ended` is true. How a reward model is both trained
    (`train_reward_model`) and read (`SequenceClassifierReward`)."""
    if len(prompts) != len(responses) or (ended is not None and len(ended) != len(responses)):
        raise ValueError(f"encode_pairs got {len(prompts)} prompts, {len(responses)} responses" + (f" and {len(ended)} ended flags" if ended is not None else "") + "; expected as many of each")
    if not responses:
        raise ValueError("encode_pairs got no responses to encode")
    texts = [p + (r if r[:1].isspace() else " " + r) for p, r in zip(prompts, responses)]
    rows = tokenizer(texts)["input_ids"]
    if ended is not None:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the reward tokenizer has no EOS token to mark the responses that ended")
        rows = [row + [eos] if e and row[-1:] != [eos] else row for row, e in zip(rows, ended)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], att[i, : len(row)] = torch.tensor(row, dtype=torch.long), 1
    return ids, att


def reads_token_ids(reward_fn, tokenizer) -> bool:
    """Whether the trainer can hand `reward_fn` the sampled token ids (see the module docstring):
    a decoder reward model with the policy's tokenizer."""
    shares = getattr(reward_fn, "shares_tokenizer", None)
    decoder = reads_at_a_token(getattr(reward_fn, "model", None))
    return decoder and callable(getattr(reward_fn, "score_ids", None)) and callable(shares) and bool(shares(tokenizer))


def takes_ended(reward_fn) -> bool:
    """Whether `reward_fn` accepts the `ended` keyword."""
    try:
        return "ended" in inspect.signature(reward_fn).parameters
    except (TypeError, ValueError):
        return False


def score_responses(reward_fn, prompts: list[str], responses: list[str], sample, by_ids: bool):
    """Call the reward the way it can be called best: with the sampled ids (`by_ids`, from
    `reads_token_ids`), with the texts and `ended`, or with the texts alone. `sample` is the
    `sampling.Sample` the responses came from. Returns what the reward returned."""
    if by_ids:
        return reward_fn.score_ids(sample.query_ids, sample.query_mask, sample.response_ids, sample.mask, sample.ended)
    if takes_ended(reward_fn):
        return reward_fn(prompts, responses, ended=sample.ended.tolist())
    return reward_fn(prompts, responses)


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
            sys.path.append(os.getcwd())  # `ppo-lab train --reward.source my_rewards:score` from the folder holding my_rewards.py
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"reward {spec!r}: cannot import {attr!r} from module {module!r} ({err})") from None
        if not callable(fn):
            raise ValueError(f"reward {spec!r} is not callable")
        return fn
    return SequenceClassifierReward(spec, label_index, device, trust_remote_code=trust_remote_code)
