"""Rollouts: sample responses, then score every response token with each model once.

Chapter 7 (The PPO trainer end to end) reads this module. A rollout turns a batch of prompts
into everything the update needs:

1. tokenize the prompts, left-padded, so every response starts at the same column;
2. sample the responses with the KV cache (`generate`, a plain loop over `sample_tokens`), at
   the configured temperature;
3. cut each response after its first stop token (`response_mask`), which works even when the
   tokenizer pads with its EOS token;
4. one forward of the policy over prompt + response for the old log-probs (and the values, if
   the critic shares its backbone), one of the reference for its log-probs, and one of a
   separate critic for the values: three forwards at most, none repeated.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ._checks import NonFiniteError
from .logprobs import chunked_logprobs, entropy_from_logits, logprobs_from_logits
from .masked import response_mask


@dataclass
class Rollout:
    """One batch of sampled responses and their per-token quantities (all (B, T) unless noted)."""

    prompts: list[str]
    responses: list[str]
    query_ids: torch.Tensor  # (B, P) left-padded prompt tokens
    query_mask: torch.Tensor  # (B, P) 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, T) sampled tokens, pad after the stop token
    mask: torch.Tensor  # (B, T) 1 on real response tokens, stop token included
    old_logprobs: torch.Tensor  # log pi_old of the response tokens (the policy that sampled them)
    ref_logprobs: torch.Tensor  # log pi_ref of the same tokens
    values: torch.Tensor | None  # V(s_t) from the critic (None without one)
    entropy: torch.Tensor  # per-token entropy of pi_old
    scores: torch.Tensor  # (B,) raw scores from the reward
    has_eos: torch.Tensor  # (B,) whether the response stopped by itself
    group_ids: torch.Tensor  # (B,) index of the prompt each response answers
    sampler_logprobs: torch.Tensor | None = None  # log pi_s: the sampler's log-probs of the tokens (None if not kept)
    weights: torch.Tensor | None = None  # rollout-correction weights pi_old / pi_s, truncated or masked (None: off)

    def __len__(self) -> int:
        return self.response_ids.shape[0]


def cat_rollouts(parts: list[tuple[Rollout, torch.Tensor]], pad_id: int) -> Rollout:
    """The rows `rows` (a 1-D index tensor) of each rollout in `parts`, as one rollout.

    Prompts are left-padded and responses right-padded to the longest of the parts (padding is
    masked out, and position ids count real tokens, so the log-probs do not change); group ids
    are renumbered so that groups from different rollouts stay apart. Used by dynamic sampling.
    """
    P = max(ro.query_ids.shape[1] for ro, _ in parts)
    T = max(ro.response_ids.shape[1] for ro, _ in parts)

    def pad(x, width, value, front=False):
        missing = width - x.shape[1]
        if missing == 0:
            return x
        fill = torch.full((x.shape[0], missing), value, dtype=x.dtype, device=x.device)
        return torch.cat([fill, x] if front else [x, fill], dim=1)

    fields: dict[str, list] = {}
    offset = 0
    for ro, rows in parts:
        idx = rows.tolist()
        for name in ("prompts", "responses"):
            fields.setdefault(name, []).extend(getattr(ro, name)[i] for i in idx)
        for name in ("query_ids", "query_mask"):
            fields.setdefault(name, []).append(pad(getattr(ro, name)[rows], P, pad_id if name == "query_ids" else 0, front=True))
        for name in ("response_ids", "mask", "old_logprobs", "ref_logprobs", "values", "entropy", "sampler_logprobs", "weights"):
            value = getattr(ro, name)
            fields.setdefault(name, []).append(None if value is None else pad(value[rows], T, pad_id if name == "response_ids" else 0))
        for name in ("scores", "has_eos"):
            fields.setdefault(name, []).append(getattr(ro, name)[rows])
        _, groups = torch.unique(ro.group_ids[rows], return_inverse=True)
        fields.setdefault("group_ids", []).append(groups + offset)
        offset += int(groups.max()) + 1 if len(idx) else 0
    out = {}
    for name, values in fields.items():
        if name in ("prompts", "responses"):
            out[name] = values
        elif any(v is None for v in values):
            out[name] = None
        else:
            out[name] = torch.cat(values)
    return Rollout(**out)


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
        raise ValueError(f"{type(model).__name__} has no output embedding (LM head): logprob_chunk_size needs one")
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
    return logprobs, entropy, values


@torch.no_grad()
def check_chunkable(model, input_ids: torch.Tensor) -> None:
    """Refuse `logprob_chunk_size` for a model whose logits are not its head applied to the
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
            f"PPOConfig.logprob_chunk_size needs logits = lm_head(hidden states), but {type(model).__name__} changes its logits "
            "after the head (e.g. soft-capping or a logit scale); set logprob_chunk_size to None for this model"
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


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Draw one token per row from softmax(logits / temperature) by inverting its CDF at `uniforms`.

    Args:
        logits: (B, V) next-token logits.
        uniforms: (B,) numbers in [0, 1), one per row.
        temperature, top_k, top_p: as in `PPOConfig` (top_k = 0 and top_p = 1 switch them off).

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


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How responses are sampled: `PPOConfig`'s generation fields as one object.

    `temperature`, `top_k` and `top_p` are those of `sample_tokens` (top_k = 0 and top_p = 1
    switch them off); a response ends after its first token in `stop_ids` at a position >=
    `stop_after` (empty `stop_ids`: exactly `max_new_tokens` tokens are sampled, as benchmarks
    do). A stop token before `stop_after` is an ordinary token: the window decides where a
    response ends, not what is sampled, so log-probs need no masking of the stop tokens.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    stop_after: int = 0

    def __post_init__(self):
        object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
        if self.max_new_tokens < 1:
            raise ValueError(f"Sampling.max_new_tokens = {self.max_new_tokens!r} must be >= 1")
        if not 0 <= self.stop_after < self.max_new_tokens:
            raise ValueError(f"Sampling.stop_after = {self.stop_after!r} must be in [0, max_new_tokens = {self.max_new_tokens})")
        if not self.temperature > 0:
            raise ValueError(f"Sampling.temperature = {self.temperature!r} must be > 0")


@dataclass
class Sample:
    """What `generate` returns (all (B, T) unless noted)."""

    query_ids: torch.Tensor  # (B, P) left-padded prompt tokens
    query_mask: torch.Tensor  # (B, P)
    response_ids: torch.Tensor  # pad after the stop token
    mask: torch.Tensor  # 1 on real response tokens, stop token included
    ended: torch.Tensor  # (B,) bool: the response ended with a stop token (it did not run out of tokens)
    old_logprobs: torch.Tensor | None = None  # log pi(token) at the temperature, from the sampling logits
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None  # from `value_head` on the hidden state that chose each token


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], sampling: Sampling, *, device=None, uniforms: torch.Tensor | None = None, with_logprobs: bool = False, with_entropy: bool | None = None, value_head=None) -> Sample:
    """Sample one response per prompt with the KV cache.

    A plain sampling loop rather than `model.generate`: one forward per new token on the cached
    keys and values, tokens drawn with `sample_tokens`. It stops when every row has produced a
    stop token (looked at every `READ_BACK_EVERY` tokens; tokens drawn past the stop are
    dropped, so the result does not depend on it). `uniforms` (B, max_new_tokens) fixes the random draws (default: from torch's
    generator); `device` defaults to the model's.

    With `with_logprobs`, the log-prob and (unless `with_entropy` is False) the entropy of every
    sampled token are taken from the very logits it was sampled from (at the temperature, before top-k / top-p), which saves the
    policy's scoring forward; `value_head` (a module mapping hidden states to values) does the
    same for a value head on the policy's backbone. In float32 they agree with a full forward
    to round-off (tested); in bf16 the cached and the full forward differ more, which is why
    the trainer recomputes them there (`PPOConfig.old_logprobs`).
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
    attention = query_mask
    hidden = value_head is not None
    keep = {"logits_to_keep": 1} if supports_logits_to_keep(model) else {}
    out = model(input_ids=query_ids, attention_mask=attention, position_ids=positions, use_cache=True, output_hidden_states=hidden, **keep)
    last = positions[:, -1:]
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    with_entropy = with_logprobs if with_entropy is None else with_entropy and with_logprobs
    tokens, logprobs, entropy, values, flags = [], [], [], [], []
    for t in range(sampling.max_new_tokens):
        logits = out.logits[:, -1, :]
        token = sample_tokens(logits, uniforms[:, t], sampling.temperature, sampling.top_k, sampling.top_p)
        tokens.append(token)
        if with_logprobs:
            z = logits.float() / sampling.temperature
            norm = torch.logsumexp(z, dim=-1)
            logprobs.append(z.gather(-1, token[:, None]).squeeze(-1) - norm)
            if with_entropy:
                entropy.append(norm - (torch.softmax(z, dim=-1) * z).sum(-1))
        if hidden:
            state = out.hidden_states[-1][:, -1]
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
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        last = last + 1
        out = model(input_ids=token[:, None], attention_mask=attention, position_ids=last, past_key_values=out.past_key_values, use_cache=True, output_hidden_states=hidden)
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
