"""The decode step of the sampling loop: a KV cache that grows, or fixed buffers replayed as a CUDA graph.

Chapter 9 (Scaling up) reads this module. `sampling.generate` samples one token per forward and
calls a decoder for each forward: `prefill` reads the prompts, `step` reads one new token per row.
Three decoders do the same arithmetic on different memory:

- `DynamicDecoder` ("dynamic", the default and the fallback): transformers' growing cache. Each
  step concatenates one column onto every layer's keys and values and onto the attention mask.
  It works for every causal LM; on a GPU it is launch-bound on small models, since every step
  allocates and copies.
- `StaticDecoder` ("static"): a `transformers.StaticCache` of P + T slots made once, and a
  (B, 1, 1, P + T) attention mask opened one column per step in place. A step reads and writes
  only buffers that exist before it starts (the token, its position, its cache slot, the mask),
  and issues no host read. It exists for the graph: on two CPU cores it took the same time as
  "dynamic" on the tiny model (64 rows x 24 tokens) and 8% longer on an 8-layer, d = 512 Llama
  over 128 tokens (its attention reads all P + T slots at every step).
- `GraphedDecoder` ("cuda_graph", CUDA only): the static step captured once per call of
  `generate` as a CUDA graph and replayed, one launch per token instead of one per kernel.
  Before it is trusted, two replays are checked against the same steps run eagerly; a graph that
  cannot be captured, or disagrees, is dropped with a warning and the static step runs eagerly.

The loop always calls a decoder, so the sampling loop holds no `if` per cache. The decoder does
not change what is sampled: the draws are fixed per row (`sampling.sample_tokens`), and the
static step computes the dynamic one's logits up to float round-off (the masked-out slots add
exact zeros). In float32 on a CPU the tokens come out identical (tested on the tiny GPT-2 and a
tiny Llama with left-padded prompts); in bf16 the two round differently, and a draw that falls
on a boundary between two tokens can flip. "auto" picks "cuda_graph" on a CUDA device for a
model that supports a static cache, else "dynamic".

Why the mask is built here rather than by transformers: a 2-D mask makes the model build its 4-D
mask at every step, and some of those checks read tensor values on the host (not allowed inside
a CUDA graph capture). A 4-D mask is passed through as it is.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from .rollout import _unwrap, supports_logits_to_keep

DECODES = ("auto", "dynamic", "static", "cuda_graph")
STATIC_ATTENTION = ("sdpa", "eager")  # the attention kernels that take a ready 4-D mask as it is


def static_cache_support(model) -> str | None:
    """None when `model` (possibly wrapped by peft or DDP) can decode on a static cache, else why not.

    It needs a transformers model that can be compiled whole (`_can_compile_fullgraph`: its cache
    updates are in place), full attention on every layer (a sliding window needs another mask),
    and SDPA or eager attention (flash attention takes no 4-D mask).
    """
    base = _unwrap(model, "_can_compile_fullgraph")
    if base is None or not getattr(base, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} does not support a static KV cache (transformers' _can_compile_fullgraph is not set)"
    config = _unwrap(model, "config").config
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config  # (what StaticCache reads)
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {"full_attention"} or (not kinds and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)):
        return f"{type(base).__name__} has sliding-window attention layers ({sorted(kinds) or 'sliding_window'}), which the static decode's mask does not model"
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in STATIC_ATTENTION:
        return f"{type(base).__name__} uses attn_implementation = {attention!r}; the static decode needs one of {STATIC_ATTENTION}"
    return None


def resolve_decode(requested: str, model, device) -> tuple[str, str]:
    """(decode, why): the decoder `generate` will use for `model` on `device`, and the reason.

    "auto" falls back to "dynamic" (on CPU, or for a model without a static cache); an explicit
    "static" or "cuda_graph" the model or device cannot run is refused with the reason.
    """
    if requested not in DECODES:
        raise ValueError(f"sampling.decode = {requested!r}; valid values are: {', '.join(map(repr, DECODES))}")
    device = torch.device(device)
    unsupported = static_cache_support(model)
    if requested == "auto":
        if device.type != "cuda":
            return "dynamic", f"auto on {device.type}: CUDA graphs need a CUDA device"
        if unsupported:
            return "dynamic", f"auto: {unsupported}"
        return "cuda_graph", "auto on CUDA"
    if requested in ("static", "cuda_graph") and unsupported:
        raise ValueError(f"sampling.decode = {requested!r}: {unsupported}; use sampling.decode = 'dynamic' (or 'auto', which falls back to it)")
    if requested == "cuda_graph" and device.type != "cuda":
        raise ValueError(f"sampling.decode = 'cuda_graph' needs a CUDA device (this run is on {device.type}); use 'static' or 'dynamic'")
    return requested, "as configured"


def make_decoder(model, decode: str, device, hidden: bool = False):
    """The decoder object for `sampling.decode` (resolved with `resolve_decode`)."""
    kind, _ = resolve_decode(decode, model, device)
    return {"dynamic": DynamicDecoder, "static": StaticDecoder, "cuda_graph": GraphedDecoder}[kind](model, hidden)


def _read(out, hidden: bool):
    """(B, V) logits of the last position, and (B, H) its last hidden state (None unless `hidden`)."""
    return out.logits[:, -1, :], (out.hidden_states[-1][:, -1] if hidden else None)


class DynamicDecoder:
    """transformers' growing KV cache: each step adds one column to the cache and to the mask.

    `prefill(query_ids, query_mask, positions, max_new_tokens)` and `step(token)` each return
    ((B, V) next-token logits, (B, H) last hidden state or None); `hidden` asks for the latter
    (a value head on the policy's backbone reads it).
    """

    name = "dynamic"

    def __init__(self, model, hidden: bool = False):
        self.model, self.hidden = model, hidden

    def prefill(self, query_ids, query_mask, positions, max_new_tokens: int):
        keep = {"logits_to_keep": 1} if supports_logits_to_keep(self.model) else {}
        out = self.model(input_ids=query_ids, attention_mask=query_mask, position_ids=positions, use_cache=True, output_hidden_states=self.hidden, **keep)
        self.attention, self.position, self.cache = query_mask, positions[:, -1:], out.past_key_values
        return _read(out, self.hidden)

    def step(self, token):
        self.attention = torch.cat([self.attention, torch.ones_like(self.attention[:, :1])], dim=1)  # (B, P + t + 1)
        self.position = self.position + 1
        out = self.model(
            input_ids=token[:, None], attention_mask=self.attention, position_ids=self.position, past_key_values=self.cache,
            use_cache=True, output_hidden_states=self.hidden,
        )
        self.cache = out.past_key_values
        return _read(out, self.hidden)


class StaticDecoder(DynamicDecoder):
    """Fixed buffers: a static cache of P + T slots and a (B, 1, 1, P + T) mask, made at prefill.

    `forward` is the decode step proper: it opens the mask's column of the current slot, runs the
    model on the token buffer, and advances the position and the slot, all in place on the
    device, so that a CUDA graph of it can be replayed as it is (`GraphedDecoder`).
    """

    name = "static"

    def prefill(self, query_ids, query_mask, positions, max_new_tokens: int):
        from transformers import StaticCache

        b, p = query_ids.shape
        device = query_ids.device
        self.cache = StaticCache(config=_unwrap(self.model, "config").config, max_cache_len=p + max_new_tokens)
        keep = {"logits_to_keep": 1} if supports_logits_to_keep(self.model) else {}
        out = self.model(
            input_ids=query_ids, attention_mask=query_mask, position_ids=positions, past_key_values=self.cache,
            cache_position=torch.arange(p, device=device), use_cache=True, output_hidden_states=self.hidden, **keep,
        )
        # The slots of the responses start closed and open one per step; the prompt's padding
        # stays closed. SDPA takes a boolean mask (True = attend), eager attention an additive one.
        allowed = torch.cat([query_mask.bool(), torch.zeros(b, max_new_tokens, dtype=torch.bool, device=device)], dim=1)[:, None, None, :]
        if _unwrap(self.model, "config").config._attn_implementation == "sdpa":
            self.mask, self.open = allowed, True  # (B, 1, 1, P + T)
        else:
            dtype = next(self.model.parameters()).dtype
            self.mask, self.open = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min), 0.0
        self.token = torch.zeros(b, 1, dtype=torch.long, device=device)  # (B, 1) the token to read next
        self.position = positions[:, -1:] + 1  # (B, 1) its position id (real tokens before it)
        self.slot = torch.tensor([p], device=device)  # (1,) its cache slot, the same for every row
        return _read(out, self.hidden)

    def forward(self):
        """One decode step on the buffers (the part a CUDA graph captures)."""
        self.mask.index_fill_(-1, self.slot, self.open)
        out = self.model(
            input_ids=self.token, attention_mask=self.mask, position_ids=self.position, past_key_values=self.cache,
            cache_position=self.slot, use_cache=True, output_hidden_states=self.hidden,
        )
        self.position.add_(1)
        self.slot.add_(1)
        return _read(out, self.hidden)

    def step(self, token):
        self.token.copy_(token[:, None])
        return self.forward()


class GraphedDecoder(StaticDecoder):
    """The static step as a CUDA graph: the first step runs eagerly (the warm-up a capture needs),
    the second is captured, and every later token replays it.

    Before the graph is trusted, two replays are checked against two eager steps from the same
    state (a graph that froze a value at capture is right at the first replay and wrong from the
    second); this costs two replays and three eager forwards per call of `generate`. If capturing
    fails or a replay disagrees, the graph is dropped with a warning and the eager static step
    continues: the same arithmetic, slower. A model whose capture failed is not captured again.
    `replay` is then False.
    """

    name = "cuda_graph"
    CHECK_TOLERANCE = 1e-3  # the largest |difference| / max |finite value| a checked replay may show, per output
    failed = weakref.WeakSet()  # the models whose step could not be captured

    def prefill(self, query_ids, query_mask, positions, max_new_tokens: int):
        self.replay, self.checked = (False if self.model in self.failed else None), False
        return super().prefill(query_ids, query_mask, positions, max_new_tokens)

    def step(self, token):
        self.token.copy_(token[:, None])
        if self.replay is False:  # no graph: the eager static step
            return self.forward()
        if self.replay is None:  # the first step: warm up eagerly, then capture the next one
            first = self._warm_up()
            self.replay = self._capture()
            return first
        if not self.checked:
            return self._checked()
        return self.replay()

    def _warm_up(self):
        # On a side stream, as torch.cuda.graphs asks: lazy initialisations (autocast's bf16
        # copies of the weights, cached for the whole autocast region `generate` runs in) happen
        # here, outside the capture, and the graph then reads them.
        with torch.cuda.device(self.token.device):
            current = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                first = self.forward()
            current.wait_stream(side)
            for x in first:  # made on the side stream, read on this one
                if x is not None:
                    x.record_stream(current)
        return first

    def _capture(self):
        """A function that replays the captured step and returns its (static) outputs, or False.

        `capture_begin` / `capture_end` rather than `torch.cuda.graph`, whose entry synchronises
        and empties the allocator's cache at every call of `generate`."""
        try:
            with torch.cuda.device(self.token.device):
                current = torch.cuda.current_stream()
                stream = torch.cuda.Stream()
                stream.wait_stream(current)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(stream):
                    graph.capture_begin()
                    try:
                        outputs = self.forward()  # recorded, not run: the buffers do not move
                    finally:
                        graph.capture_end()
                current.wait_stream(stream)
        except Exception as error:  # noqa: BLE001 - whatever breaks the capture, the eager step still works
            cause = error.__context__ or error  # (capture_end's "invalidated" hides the first error)
            self.failed.add(self.model)
            self._give_up(f"capturing the decode step failed ({type(cause).__name__}: {cause})")
            return False

        def replay():
            graph.replay()
            return outputs

        return replay

    def _state(self) -> list[torch.Tensor]:
        """What a step changes besides the cache's contents: the position, the slot, the mask, and
        the cache's own write counters."""
        layers = getattr(self.cache, "layers", ())
        counters = [c for c in (getattr(layer, "cumulative_length", None) for layer in layers) if isinstance(c, torch.Tensor)]
        return [self.position, self.slot, self.mask, *counters]

    def _rewind(self, saved) -> None:
        for tensor, value in zip(self._state(), saved):
            tensor.copy_(value)

    def _checked(self):
        """Two replays, then two eager steps from the same state; the graph is kept only if each
        pair agrees. Returns the eager outputs of this step, from the state it started in."""
        self.checked = True
        saved = [t.clone() for t in self._state()]
        graphed = [[x.clone() if x is not None else None for x in self.replay()] for _ in range(2)]
        self._rewind(saved)
        eager = [self.forward() for _ in range(2)]
        gap = max(_gap(g, e) for gs, es in zip(graphed, eager) for g, e in zip(gs, es) if e is not None)
        if not gap <= self.CHECK_TOLERANCE:  # (nan fails too)
            self._give_up(f"a replay differs from the eager step by {gap:.3g} (relative)")
        self._rewind(saved)  # the slots the check wrote are written again before they are read
        return self.forward()

    def _give_up(self, why: str):
        warnings.warn(f"sampling.decode = 'cuda_graph': {why}; the static decode step runs without a graph (same arithmetic, slower)", RuntimeWarning, stacklevel=5)
        self.replay = False


def _gap(graphed: torch.Tensor, eager: torch.Tensor) -> float:
    """max |graphed - eager| over max |eager|, over the finite values (an equal -inf is no gap)."""
    graphed, eager = graphed.float(), eager.float()
    diff = torch.where(graphed == eager, torch.zeros_like(eager), (graphed - eager).abs())
    finite = eager[torch.isfinite(eager)]
    scale = finite.abs().max().clamp(min=1.0) if finite.numel() else torch.tensor(1.0)
    return (diff.max() / scale).item()
