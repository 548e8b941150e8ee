"""Scoring a rollout: every response token through each model once.

Chapter 7 (The PPO trainer end to end) reads this module. After sampling (`sampling.py`), one
forward of the policy over prompt + response gives the old log-probs (and the values, if the
critic shares its backbone), one of the reference its log-probs, and one of a separate critic
the values: three forwards at most, none repeated (`score_tokens`). The same forwards serve the
update (`response_logprobs`, `critic_values`). Position ids count real tokens, so a left-padded
prompt is read exactly as it was during generation.
"""

from __future__ import annotations

import contextlib

import torch

from .logprobs import chunked_logprobs, entropy_from_logits, logprobs_from_logits


def full_sequence(query_ids, query_mask, response_ids, mask):
    """Prompt + response as one (B, L) sequence, L = P + T, with its attention mask and positions.

    Position ids count real tokens only, so a left-padded prompt starts at position 0 exactly
    as it did during generation.
    """
    input_ids = torch.cat([query_ids, response_ids], dim=1)
    attention = torch.cat([query_mask, mask.to(query_mask.dtype)], dim=1)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention, position_ids


def response_logits(model, query_ids, query_mask, response_ids, mask):
    """(B, T, V) logits that predict each response token (from the position before it).

    The LM head runs on those R positions only when the model supports `logits_to_keep`
    (transformers' causal LMs do): the prompt's logits would be computed and thrown away.
    """
    input_ids, attention, position_ids = full_sequence(query_ids, query_mask, response_ids, mask)
    p, r = query_ids.shape[1], response_ids.shape[1]
    # use_cache=False: a scoring or training forward has no next token, so a KV cache for the
    # whole sequence would only cost memory (and gradient checkpointing refuses it).
    keep = {"logits_to_keep": r + 1} if supports_logits_to_keep(model) else {}
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=False, **keep)
    logits = out[0] if isinstance(out, tuple) else out.logits
    values = out[1] if isinstance(out, tuple) else None
    logits = logits[:, -(r + 1) : -1]  # the position before each response token
    return logits, (values[:, p - 1 : -1] if values is not None else None)


def output_head(model):
    """The LM head (output embedding) of `model`, through DDP, torch.compile, peft and the
    shared critic's `PolicyWithValueHead` wrappers."""
    found = _unwrap(model, "get_output_embeddings")
    for attribute in ("lm", "policy"):  # PolicyWithValueHead.lm, lora.LoRAReference.policy
        holder = _unwrap(model, attribute) if found is None else None
        if holder is not None:
            found = _unwrap(getattr(holder, attribute), "get_output_embeddings")
    head = found.get_output_embeddings() if found is not None else None
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (LM head): memory.logprob_chunk needs one")
    return head


@contextlib.contextmanager
def hidden_states_as_logits(model):
    """Inside this block the LM head of `model` returns its input, so the model's "logits" are
    the hidden states its head would read. The forward still runs through every wrapper (DDP
    needs that), and the head's weight is then applied chunk by chunk (`chunked_logprobs`)."""
    head = output_head(model)
    had = "forward" in vars(head)
    saved = vars(head).get("forward")
    head.forward = lambda x: x
    try:
        yield head
    finally:
        if had:
            head.forward = saved
        else:
            del head.forward


def response_logprobs(model, query_ids, query_mask, response_ids, mask, temperature, *, chunk_size=None, with_entropy=False, float32=False):
    """(logprobs, entropy or None, values or None) of the response tokens under `model`, each (B, T).

    With `chunk_size` the (B, T, V) logits are never formed: the forward returns hidden states
    and `chunked_logprobs` applies the LM head `chunk_size` positions at a time (the model must
    compute its logits as head(hidden); `check_chunkable` tests that once). `float32` casts
    half-precision logits to float32 first, as accelerate does to the prepared policy's outputs,
    so that a frozen model (the reference) goes through the same float32 arithmetic as the policy
    and the two agree exactly when their weights do (on CUDA the per-row half-precision path
    rounds differently, by ~1e-7).
    """
    if chunk_size is None:
        logits, values = response_logits(model, query_ids, query_mask, response_ids, mask)
        if float32:
            logits = logits.float()
        entropy = entropy_from_logits(logits, temperature) if with_entropy else None
        return logprobs_from_logits(logits, response_ids, temperature), entropy, values
    with hidden_states_as_logits(model) as head:
        hidden, values = response_logits(model, query_ids, query_mask, response_ids, mask)
    logprobs, entropy = chunked_logprobs(hidden, head, response_ids, temperature, chunk_size, with_entropy)
    if not torch.is_grad_enabled() and callable(getattr(model, "reshard", None)):
        # a sharded model (FSDP2) kept its root's weights (the head) gathered for the chunks; with
        # no backward to come, a frozen one would keep them for good: give them back now
        model.reshard()
    return logprobs, entropy, values


@torch.no_grad()
def check_chunkable(model, input_ids: torch.Tensor) -> None:
    """Refuse `memory.logprob_chunk` for a model whose logits are not its head applied to the
    hidden states (Gemma 2's soft-capping and Cohere's logit scale act after the head)."""
    attention = torch.ones_like(input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False)
    logits = (out[0] if isinstance(out, tuple) else out.logits).float()
    with hidden_states_as_logits(model) as head:
        out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False)
        hidden = out[0] if isinstance(out, tuple) else out.logits
    rebuilt = head(hidden).float()
    if rebuilt.shape != logits.shape or not torch.allclose(rebuilt, logits, rtol=1e-3, atol=1e-3 * (1 + logits.abs().max().item())):
        raise ValueError(
            f"memory.logprob_chunk needs logits = lm_head(hidden states), but {type(model).__name__} changes its logits "
            "after the head (e.g. soft-capping or a logit scale); set memory.logprob_chunk to None for this model"
        )


def _unwrap(model, attribute: str):
    """The first of `model` and the models it wraps (DDP, torch.compile, peft) that has `attribute`."""
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, attribute):
            return model
        model = _inner(model)
    return None


def supports_logits_to_keep(model) -> bool:
    """Whether `model` (possibly wrapped by DDP, torch.compile or peft) takes `logits_to_keep`."""
    import inspect

    flagged = _unwrap(model, "accepts_logits_to_keep")
    if flagged is not None:
        return bool(flagged.accepts_logits_to_keep)
    base = model
    while True:
        inner = _inner(base)
        if inner is None:
            break
        base = inner
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False


def _inner(model):
    modules = vars(model).get("_modules", {})
    inner = modules.get("module") or modules.get("_orig_mod")
    if inner is None and hasattr(model, "get_base_model"):
        inner = model.get_base_model()
        if inner is model:
            return None
    return inner


def critic_values(critic, query_ids, query_mask, response_ids, mask):
    """(B, T) V(s_t) for each response token, from the hidden state before it."""
    input_ids, attention, position_ids = full_sequence(query_ids, query_mask, response_ids, mask)
    p = query_ids.shape[1]
    return critic(input_ids=input_ids, attention_mask=attention, position_ids=position_ids)[:, p - 1 : -1]


@torch.no_grad()
def score_tokens(policy, reference, critic, query_ids, query_mask, response_ids, mask, temperature, *, old_logprobs=None, entropy=None, values=None, batch_size=None, chunk_size=None):
    """(old_logprobs, ref_logprobs, values, entropy) of the sampled tokens, each (B, T); values None without a critic.

    `critic` is None when the policy carries the value head (its forward returns values too).
    Whatever the sampling loop already computed (`old_logprobs` with `entropy`, `values`) is used
    as given, and a forward that would only recompute it is skipped. `batch_size` (default: all
    rows at once) scores that many rows per forward, which bounds the (rows, T, V)
    logits held at once; each row's results do not depend on it beyond float round-off.
    `chunk_size` computes the log-probs from hidden states, that many positions at a time
    (`response_logprobs`).
    """
    n = query_ids.shape[0]
    if batch_size is not None and batch_size < n:
        parts = [
            score_tokens(
                policy, reference, critic, query_ids[i : i + batch_size], query_mask[i : i + batch_size],
                response_ids[i : i + batch_size], mask[i : i + batch_size], temperature, chunk_size=chunk_size,
                **{k: v[i : i + batch_size] if v is not None else None for k, v in (("old_logprobs", old_logprobs), ("entropy", entropy), ("values", values))},
            )
            for i in range(0, n, batch_size)
        ]
        return tuple(torch.cat(list(column)) if column[0] is not None else None for column in zip(*parts))
    need_values = critic is None and values is None and _unwrap(policy, "v_head") is not None
    if old_logprobs is None or need_values:
        logprobs, head_entropy, head_values = response_logprobs(
            policy, query_ids, query_mask, response_ids, mask, temperature, chunk_size=chunk_size, with_entropy=old_logprobs is None
        )
        if old_logprobs is None:
            old_logprobs, entropy = logprobs, head_entropy
        if need_values:
            values = head_values
    ref_logprobs, _, _ = response_logprobs(reference, query_ids, query_mask, response_ids, mask, temperature, chunk_size=chunk_size, float32=True)
    if critic is not None and values is None:
        values = critic_values(critic, query_ids, query_mask, response_ids, mask)
    return old_logprobs, ref_logprobs, (values.float() if values is not None else None), entropy
