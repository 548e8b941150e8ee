"""Log-probabilities and entropy of tokens under a language model's logits.

Chapter 1 (RL for language models) introduces these: the policy is the model's next-token
distribution, and everything PPO does is arithmetic on the log-probabilities of the tokens it
sampled.

Temperature. A response sampled at temperature tau was drawn from softmax(logits / tau), so that
is the policy whose log-probabilities enter the ratio, the KL and the entropy. `ppo_lab` applies
the same tau in sampling and in every log-prob forward (policy, old policy and reference), as TRL
does; verl and OpenRLHF do the same. Scoring with tau = 1 after sampling at tau = 0.7 would make
the "on-policy" ratio differ from 1 before any update.

Memory. The logits of a batch are (B, T, V) with V in the tens of thousands; a full log-softmax
copy of them is often the largest tensor of an update. These functions never keep one: for
float32/float64 logits at tau = 1 they use gather - logsumexp, and otherwise they work one
sequence at a time so that only one (T, V) temporary exists at once.
"""

from __future__ import annotations

import torch

from ._checks import check_float, check_range, check_tensor

_FULL_PRECISION = (torch.float32, torch.float64)


def scaled_rows(logits: torch.Tensor, temperature: float):
    """Yield each sequence's logits (T, V) in at least float32, divided by the temperature."""
    for row in logits:
        if row.dtype not in _FULL_PRECISION:
            # bf16 has 8 bits of mantissa: its logsumexp is off by ~1e-2 nats, which is the
            # size of a whole PPO step. Upcast one row at a time instead of the whole batch.
            row = row.float()
        yield row / temperature if temperature != 1.0 else row


def logprobs_from_logits(
    logits: torch.Tensor, response_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each given token under softmax(logits / temperature).

    Args:
        logits: (B, T, V) next-token logits; `logits[b, t]` is the distribution of `response_ids[b, t]`
            (shift the model's output by one position before calling).
        response_ids: (B, T) integer token ids.
        temperature: tau > 0, the same value that was used for sampling.

    Returns:
        (B, T) log-probabilities, float32 for half-precision logits (else the logits' dtype).

    Naive equivalent::

        torch.log_softmax(logits / temperature, -1).gather(-1, response_ids[..., None]).squeeze(-1)

    Example: logits [[[0., 0.]]] (two equally likely tokens), response_ids [[1]] -> [[-0.6931]].
    """
    check_tensor("logits", logits, ndim=3)
    check_float(logits=logits)
    check_tensor("response_ids", response_ids, ndim=2)
    if logits.shape[:2] != response_ids.shape:
        raise ValueError(
            f"`logits` has shape {tuple(logits.shape)} but `response_ids` has shape "
            f"{tuple(response_ids.shape)}; expected logits (B, T, V) and response_ids (B, T)"
        )
    if response_ids.is_floating_point():
        raise ValueError(f"`response_ids` must hold integer ids, got dtype {response_ids.dtype}")
    temperature = check_range("temperature", temperature, low=0.0, low_open=True)

    ### BEGIN SOLUTION logprobs
    if logits.dtype in _FULL_PRECISION and temperature == 1.0:
        # log p(x) = logit_x - logsumexp(logits): one (B, T) gather, no (B, T, V) copy kept.
        picked = logits.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    out = []
    for row, row_tokens in zip(scaled_rows(logits, temperature), response_ids):
        picked = row.gather(-1, row_tokens.unsqueeze(-1)).squeeze(-1)  # (T,)
        out.append(picked - torch.logsumexp(row, dim=-1))
    return torch.stack(out)  # (B, T)
    ### END SOLUTION


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at every position.

    Args:
        logits: (B, T, V) next-token logits.
        temperature: tau > 0.

    Returns:
        (B, T) entropies in nats, float32 for half-precision logits (else the logits' dtype).

    Formula: H = logsumexp(z) - sum_v softmax(z)_v * z_v with z = logits / tau, which equals
    -sum_v p_v log p_v without forming log p. Naive equivalent::

        p = torch.softmax(logits / temperature, -1); -(p * p.log()).sum(-1)

    Example: logits [[[0., 0., 0., 0.]]] -> [[log 4]] = [[1.3863]].
    """
    check_tensor("logits", logits, ndim=3)
    check_float(logits=logits)
    temperature = check_range("temperature", temperature, low=0.0, low_open=True)
    out = []
    for row in scaled_rows(logits, temperature):
        probs = torch.softmax(row, dim=-1)  # (T, V)
        # where() keeps a -inf logit (a token masked out by top-k) from giving 0 * -inf = nan
        weighted = torch.where(probs > 0, probs * row, torch.zeros_like(row))
        out.append(torch.logsumexp(row, dim=-1) - weighted.sum(dim=-1))
    return torch.stack(out)  # (B, T)


def _chunk_logprobs(hidden: torch.Tensor, ids: torch.Tensor, head, temperature: float, with_entropy: bool):
    """Log-probs (and entropies) of one chunk of N positions: hidden (N, H), ids (N,) -> (N,) each,
    by the same functions as the unchunked path, on the chunk's (1, N, V) logits."""
    z = head(hidden)[None]  # (1, N, V)
    logprobs = logprobs_from_logits(z, ids[None], temperature)[0]
    return logprobs, (entropy_from_logits(z, temperature)[0] if with_entropy else None)


def chunked_logprobs(
    hidden: torch.Tensor, head, response_ids: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropies) of the response tokens, from hidden states, a chunk at a time.

    Args:
        hidden: (B, T, H) the last hidden states that predict each response token (the model's
            final norm applied; what its LM head reads).
        head: the LM head, a module or function mapping (N, H) to (N, V) logits.
        response_ids: (B, T) integer token ids.
        temperature: tau > 0, the sampling temperature.
        chunk_size: positions per chunk (of the B * T flattened ones).
        with_entropy: also return the (B, T) entropies.

    Returns:
        ((B, T) log-probs, (B, T) entropies or None), float32 for half-precision logits.

    Equal to `logprobs_from_logits(head(hidden), response_ids, temperature)` (and
    `entropy_from_logits`) up to float round-off, with at most `chunk_size` x V logits alive at
    once. With gradients, each chunk runs under activation checkpointing
    (`torch.utils.checkpoint`): its logits are dropped after the forward and recomputed in the
    backward pass, so the backward holds one chunk's logits, gradient and softmax, not the
    micro-batch's (what verl's `entropy_checkpointing` and Liger's fused linear cross-entropy
    also avoid).
    """
    check_tensor("hidden", hidden, ndim=3)
    check_tensor("response_ids", response_ids, ndim=2)
    if hidden.shape[:2] != response_ids.shape:
        raise ValueError(f"`hidden` has shape {tuple(hidden.shape)} but `response_ids` has shape {tuple(response_ids.shape)}; expected (B, T, H) and (B, T)")
    temperature = check_range("temperature", temperature, low=0.0, low_open=True)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size = {chunk_size!r} must be a positive integer")
    from torch.utils.checkpoint import checkpoint

    B, T, H = hidden.shape
    flat, ids = hidden.reshape(B * T, H), response_ids.reshape(B * T)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in getattr(head, "parameters", lambda: [])()))
    lps, ents = [], []
    for start in range(0, B * T, chunk_size):
        h, i = flat[start : start + chunk_size], ids[start : start + chunk_size]
        if recompute:
            lp, ent = checkpoint(_chunk_logprobs, h, i, head, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, i, head, temperature, with_entropy)
        lps.append(lp)
        ents.append(ent)
    logprobs = torch.cat(lps).reshape(B, T)
    return logprobs, (torch.cat(ents).reshape(B, T) if with_entropy else None)
