"""Sampling responses: the token draw, the settings of a rollout's sampling, and the KV-cache loop.

Chapter 7 (The PPO trainer end to end) reads this module. A rollout samples its responses here:
the prompts are tokenized left-padded, so every response starts at the same column; `generate`
samples with the KV cache (growing, or static and replayed as a CUDA graph: `decoding.py`), one forward per token, each token drawn by `sample_tokens` at the
configured temperature from draws fixed in advance (so a response depends only on its own
draws); each response is cut after its first stop token (`masked.response_mask`), which works
even when the tokenizer pads with its EOS token. The forwards that then score the tokens are
`rollout.py`'s, and the batch they fill is `batch.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import NonFiniteError
from .fields import Group, _f, group, internal
from .masked import response_mask
from .decoding import DECODES, make_decoder


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Draw one token per row from softmax(logits / temperature) by inverting its CDF at `uniforms`.

    Args:
        logits: (B, V) next-token logits.
        uniforms: (B,) numbers in [0, 1), one per row.
        temperature, top_k, top_p: as in `Sampling` (top_k = 0 and top_p = 1 switch them off).

    Returns:
        (B,) token ids. Row b's token depends only on `logits[b]` and `uniforms[b]`, never on the
        other rows, which is what lets one process and several processes (each sampling its share
        of the batch) draw the same responses from the same seed. `torch.multinomial` consumes a
        shared random stream and cannot promise that.
    """
    z = logits.float() / temperature
    if top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = (probs.cumsum(-1) - probs) > top_p
        z = z.scatter(-1, order, sorted_z.masked_fill(drop, float("-inf")))
    cdf = torch.softmax(z, dim=-1).cumsum(dim=-1)
    target = uniforms.to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(-1).clamp(max=z.shape[-1] - 1)


READ_BACK_EVERY = 8  # generated tokens between two host reads of the sampling loop's stop and nan checks


@group("sampling")
class Sampling(Group):
    """How responses are sampled: `PPOConfig.sampling`, the group of the generation settings.

    `temperature`, `top_k` and `top_p` are those of `sample_tokens` (top_k = 0 and top_p = 1
    switch them off); a response ends after its first token in `stop_ids` at a position >=
    `stop_after` (empty `stop_ids`: exactly `max_new_tokens` tokens are sampled, as benchmarks
    do). A stop token before `stop_after` is an ordinary token: the window decides where a
    response ends, not what is sampled, so log-probs need no masking of the stop tokens.
    `stop_ids` is filled in from the tokenizer when a run is built (EOS and `stop_token`, none
    with `ignore_eos`); `generate` reads only it, never `stop_token` or `ignore_eos`.
    """

    max_new_tokens: int = _f(12, "Most tokens generated per response.", low=1)
    temperature: float = _f(1.0, "Sampling temperature; the same value is used in every log-prob forward.", low=0.0, low_open=True)
    top_k: int = _f(0, "Sample from the k most likely tokens only (0 = off). Makes the PPO ratio approximate.", low=0)
    top_p: float = _f(1.0, "Nucleus sampling threshold (1.0 = off). Makes the PPO ratio approximate.", low=0.0, high=1.0, low_open=True)
    stop_token: str | None = _f(None, "An extra token that ends a response, besides EOS.")
    stop_after: int = _f(0, "A stop token (EOS or stop_token) ends a response only at response position >= stop_after (0-based); an earlier one is an ordinary token. Sampling itself is unchanged, so the ratio stays exact (OpenAI 2019: stop_token '.', stop_after 16).", low=0)
    ignore_eos: bool = _f(False, "Never stop a response: sample exactly max_new_tokens tokens, all of them real (for benchmarks).")
    responses_per_prompt: int = _f(1, "Responses sampled for each prompt (>1 for rloo/grpo).", low=1)
    dynamic: bool = _f(False, "DAPO's dynamic sampling: drop the groups whose responses all got the same raw score from the reward (their group advantages are then 0, unless the KL or the overlong penalty separates them) and sample more prompts until batch.rollout responses of informative groups are collected; needs sampling.responses_per_prompt >= 2.")
    dynamic_max_rounds: int = _f(4, "Most rollouts drawn per iteration by dynamic sampling; a batch still short after them is filled with dropped groups (verl stops the run instead).", low=1)
    decode: str = _f("dynamic", "The KV cache of the sampling loop (decoding.py): 'dynamic' grows it per token (any model); 'static' uses fixed buffers; 'cuda_graph' replays the static step as a CUDA graph (CUDA only, checked against the eager step); 'auto' = cuda_graph on CUDA when the model supports a static cache, else dynamic. The arithmetic is the same up to round-off: identical tokens in float32 on a CPU.", DECODES)
    stop_ids: tuple[int, ...] = internal((), "The token ids that end a response (from the tokenizer).")

    def check(self):
        self.stop_ids = tuple(int(i) for i in self.stop_ids)
        if self.stop_after >= self.max_new_tokens:
            raise ValueError(f"sampling.stop_after = {self.stop_after} leaves no position where a response could stop (max_new_tokens = {self.max_new_tokens})")
        if self.dynamic and self.responses_per_prompt < 2:
            raise ValueError(f"sampling.dynamic drops the groups whose responses all scored alike: set sampling.responses_per_prompt >= 2 (got {self.responses_per_prompt})")


@dataclass
class Sample:
    """What `generate` returns (all (B, T) unless noted)."""

    query_ids: torch.Tensor  # (B, P) left-padded prompt tokens
    query_mask: torch.Tensor  # (B, P)
    response_ids: torch.Tensor  # pad after the stop token
    mask: torch.Tensor  # 1 on real response tokens, stop token included
    ended: torch.Tensor  # (B,) bool: the response ended with a stop token (it did not run out of tokens)
    sampler_logprobs: torch.Tensor | None = None  # log pi(token) at the temperature, from the sampling logits
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None  # from `value_head` on the hidden state that chose each token


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], sampling: Sampling, *, device=None, uniforms: torch.Tensor | None = None, with_logprobs: bool = False, with_entropy: bool | None = None, value_head=None) -> Sample:
    """Sample one response per prompt with the KV cache.

    A plain sampling loop rather than `model.generate`: one forward per new token on the cached
    keys and values (the decoder of `sampling.decode`, `decoding.py`), tokens drawn with `sample_tokens`. It stops when every row has produced a
    stop token (looked at every `READ_BACK_EVERY` tokens; tokens drawn past the stop are
    dropped, so the result does not depend on it). `uniforms` (B, max_new_tokens) fixes the random draws (default: from torch's
    generator); `device` defaults to the model's.

    With `with_logprobs`, the log-prob and (unless `with_entropy` is False) the entropy of every
    sampled token are taken from the very logits it was sampled from (at the temperature, before top-k / top-p), which saves the
    policy's scoring forward; `value_head` (a module mapping hidden states to values) does the
    same for a value head on the policy's backbone. In float32 they agree with a full forward
    to round-off (tested); in bf16 the cached and the full forward differ more, which is why
    the trainer recomputes them there (`sampler.old_logprobs_from`).
    """
    if not isinstance(sampling, Sampling):
        raise TypeError(f"`sampling` must be a ppo_lab.Sampling(max_new_tokens=..., ...), got {type(sampling).__name__}")
    device = device if device is not None else next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    query_ids, query_mask = enc["input_ids"], enc["attention_mask"]
    batch = query_ids.shape[0]
    if uniforms is None:
        uniforms = torch.rand(batch, sampling.max_new_tokens)
    if tuple(uniforms.shape) != (batch, sampling.max_new_tokens):
        raise ValueError(f"`uniforms` has shape {tuple(uniforms.shape)}; expected ({batch}, {sampling.max_new_tokens})")
    uniforms = uniforms.to(device)
    stops = torch.tensor(sampling.stop_ids, dtype=torch.long, device=device)
    positions = (query_mask.cumsum(dim=1) - 1).clamp(min=0)
    hidden = value_head is not None
    decoder = make_decoder(model, sampling.decode, device, hidden)  # the KV cache and the decode step (decoding.py)
    logits, state = decoder.prefill(query_ids, query_mask, positions, sampling.max_new_tokens)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    with_entropy = with_logprobs if with_entropy is None else with_entropy and with_logprobs
    tokens, logprobs, entropy, values, flags = [], [], [], [], []
    for t in range(sampling.max_new_tokens):
        token = sample_tokens(logits, uniforms[:, t], sampling.temperature, sampling.top_k, sampling.top_p)
        tokens.append(token)
        if with_logprobs:
            z = logits.float() / sampling.temperature
            norm = torch.logsumexp(z, dim=-1)
            logprobs.append(z.gather(-1, token[:, None]).squeeze(-1) - norm)
            if with_entropy:
                entropy.append(norm - (torch.softmax(z, dim=-1) * z).sum(-1))
        if hidden:
            values.append(value_head(state.to(value_head.weight.dtype)).squeeze(-1).float())
        done = done | (torch.isin(token, stops) & (t >= sampling.stop_after))
        # Has every row stopped, and are the logits usable (-inf is allowed: models mask tokens
        # with it, as long as a row keeps a finite one)? Read back every READ_BACK_EVERY tokens,
        # not every token: a read waits for the GPU, and without one the host queues the next
        # steps' kernels while the GPU runs (sampling is launch-bound on small models). Tokens
        # drawn after every row stopped are cut off below, so the result is the same.
        flags.append(torch.stack([done.all(), (~torch.isnan(logits) & (logits != float("inf"))).all() & torch.isfinite(logits).any(dim=-1).all()]))
        last_step = t == sampling.max_new_tokens - 1
        if last_step or (t + 1) % READ_BACK_EVERY == 0:
            read = torch.stack(flags).tolist()  # (steps so far, 2)
            bad = next((i for i, (_, usable) in enumerate(read) if not usable), None)
            if bad is not None:
                raise NonFiniteError(
                    f"the model's logits are nan or inf at generated token {bad}: its weights are broken or its activations "
                    "overflowed (fp16), so there is nothing to sample from"
                )
            stopped = next((i for i, (all_done, _) in enumerate(read) if all_done), None)
            if stopped is not None or last_step:
                if stopped is not None:
                    tokens, logprobs, entropy, values = (x[: stopped + 1] for x in (tokens, logprobs, entropy, values))
                break
        logits, state = decoder.step(token)
    response_ids = torch.stack(tokens, dim=1)
    mask = response_mask(response_ids, list(sampling.stop_ids) or None, sampling.stop_after)
    # ended: the last real token is a stop token inside the window (mask and window agree on it)
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    final = response_ids.gather(1, last[:, None]).squeeze(1)
    ended = torch.isin(final, stops) & (last >= sampling.stop_after)
    # Anything after the stop token is replaced by pad, and its statistics by 0.
    response_ids = torch.where(mask.bool(), response_ids, torch.full_like(response_ids, tokenizer.pad_token_id))
    stacked = [torch.stack(x, dim=1) * mask if x else None for x in (logprobs, entropy, values)]
    return Sample(query_ids, query_mask, response_ids, mask, ended, *stacked)
