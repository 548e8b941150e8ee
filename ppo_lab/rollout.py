"""Rollouts: sample responses, then score every response token with each model once.

Chapter 7 (The PPO trainer end to end) reads this module. A rollout turns a batch of prompts
into everything the update needs:

1. tokenize the prompts, left-padded, so every response starts at the same column;
2. sample the responses with the KV cache (`model.generate`), at the configured temperature;
3. cut each response after its first stop token (`response_mask`), which works even when the
   tokenizer pads with its EOS token;
4. one forward of the policy over prompt + response for the old log-probs (and the values, if
   the critic shares its backbone), one of the reference for its log-probs, and one of a
   separate critic for the values: three forwards at most, none repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .logprobs import entropy_from_logits, logprobs_from_logits
from .masked import response_mask


@dataclass
class Rollout:
    """One batch of sampled responses and their per-token quantities (all (B, R) unless noted)."""

    prompts: list[str]
    responses: list[str]
    query_ids: torch.Tensor  # (B, P) left-padded prompt tokens
    query_mask: torch.Tensor  # (B, P) 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, R) sampled tokens, pad after the stop token
    mask: torch.Tensor  # (B, R) 1 on real response tokens, stop token included
    logprobs: torch.Tensor  # log pi_old of the response tokens
    ref_logprobs: torch.Tensor  # log pi_ref of the same tokens
    values: torch.Tensor | None  # V(s_t) from the critic (None without one)
    entropy: torch.Tensor  # per-token entropy of pi_old
    scores: torch.Tensor  # (B,) raw scores from the reward
    has_eos: torch.Tensor  # (B,) whether the response stopped by itself
    group_ids: torch.Tensor  # (B,) index of the prompt each response answers
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.response_ids.shape[0]


def full_sequence(query_ids, query_mask, response_ids, mask):
    """Prompt + response as one (B, P + R) sequence with its attention mask and positions.

    Position ids count real tokens only, so a left-padded prompt starts at position 0 exactly
    as it did during generation.
    """
    input_ids = torch.cat([query_ids, response_ids], dim=1)
    attention = torch.cat([query_mask, mask.to(query_mask.dtype)], dim=1)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention, position_ids


def response_logits(model, query_ids, query_mask, response_ids, mask):
    """(B, R, V) logits that predict each response token (from the position before it)."""
    input_ids, attention, position_ids = full_sequence(query_ids, query_mask, response_ids, mask)
    p = query_ids.shape[1]
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids)
    logits = out[0] if isinstance(out, tuple) else out.logits
    values = out[1] if isinstance(out, tuple) else None
    logits = logits[:, p - 1 : -1]
    return logits, (values[:, p - 1 : -1] if values is not None else None)


def critic_values(critic, query_ids, query_mask, response_ids, mask):
    """(B, R) V(s_t) for each response token, from the hidden state before it."""
    input_ids, attention, position_ids = full_sequence(query_ids, query_mask, response_ids, mask)
    p = query_ids.shape[1]
    return critic(input_ids=input_ids, attention_mask=attention, position_ids=position_ids)[:, p - 1 : -1]


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float, top_k: int, top_p: float, stop_ids: list[int], device):
    """Sample one response per prompt; returns (query_ids, query_mask, response_ids, mask)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    out = model.generate(
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_k=top_k if top_k > 0 else None,
        top_p=top_p,
        eos_token_id=stop_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    response_ids = out[:, enc["input_ids"].shape[1] :]
    mask = response_mask(response_ids, stop_ids)
    # Anything after the stop token is replaced by pad, whatever generate left there.
    response_ids = torch.where(mask.bool(), response_ids, torch.full_like(response_ids, tokenizer.pad_token_id))
    return enc["input_ids"], enc["attention_mask"], response_ids, mask


@torch.no_grad()
def score_tokens(policy, reference, critic, query_ids, query_mask, response_ids, mask, temperature):
    """Old log-probs, reference log-probs, values and entropy of the sampled tokens.

    `critic` is None when the policy carries the value head (its forward returns values too).
    """
    logits, values = response_logits(policy, query_ids, query_mask, response_ids, mask)
    logprobs = logprobs_from_logits(logits, response_ids, temperature)
    entropy = entropy_from_logits(logits, temperature)
    del logits
    ref_logits, _ = response_logits(reference, query_ids, query_mask, response_ids, mask)
    ref_logprobs = logprobs_from_logits(ref_logits, response_ids, temperature)
    del ref_logits
    if critic is not None:
        values = critic_values(critic, query_ids, query_mask, response_ids, mask)
    return logprobs, ref_logprobs, (values.float() if values is not None else None), entropy
