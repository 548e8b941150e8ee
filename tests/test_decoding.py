"""The decoders of the sampling loop draw the same tokens, and the static step is fit for a CUDA graph.

The CUDA graph itself needs a GPU (test_cuda.py); what a CPU can show is checked here: the static
cache gives the dynamic cache's tokens exactly and its log-probs, entropies and values to
round-off (the tiny GPT-2 and a tiny Llama, left-padded prompts of several lengths); its step
reads no value back to the host, keeps its buffers where they are and traces as one graph; the
graph decoder's replay check rewinds exactly, catches a graph frozen at capture and falls back to
the eager step; the choice is resolved and refused as documented.
"""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ppo_lab.decoding import DynamicDecoder, GraphedDecoder, StaticDecoder, make_decoder, resolve_decode, static_cache_support
from ppo_lab.models import load_tokenizer
from ppo_lab.sampling import Sampling, generate

PROMPTS = ["the movie was", "i think this film is really", "2 + 3 =", "the", "the food was great and the"]
STEPS = 14


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    tok = load_tokenizer(tiny_path)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def gpt2(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path).eval()


def _llama(tokenizer, attention="sdpa", **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, **extra,
    )
    config._attn_implementation = attention
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", params=["gpt2", "llama-sdpa", "llama-eager"])
def model(request, gpt2, tokenizer):
    if request.param == "gpt2":
        return gpt2
    return _llama(tokenizer, request.param.split("-")[1])


def _sample(model, tokenizer, decode, seed=0, with_head=True, **sampling):
    head = torch.nn.Linear(model.config.hidden_size, 1)
    with torch.no_grad():  # the same head for every decoder
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(1)))
        head.bias.fill_(0.5)
    uniforms = torch.rand(len(PROMPTS), STEPS, generator=torch.Generator().manual_seed(seed))
    # EOS and every 7th token end a response, so that the rows of the random Llama stop too
    stops = (tokenizer.eos_token_id, *range(3, len(tokenizer), 7))
    settings = Sampling(max_new_tokens=STEPS, stop_ids=stops, decode=decode, **sampling)
    return generate(model, tokenizer, PROMPTS, settings, uniforms=uniforms, with_logprobs=True, value_head=head if with_head else None)


def _assert_same_sample(a, b):
    assert torch.equal(a.query_mask, b.query_mask) and (a.query_mask == 0).any()  # the prompts are left-padded
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.mask, b.mask) and torch.equal(a.ended, b.ended)
    for x, y in ((a.sampler_logprobs, b.sampler_logprobs), (a.entropy, b.entropy), (a.values, b.values)):
        torch.testing.assert_close(x, y, rtol=0, atol=2e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_static_cache_draws_the_dynamic_caches_tokens(model, tokenizer, seed):
    dynamic, static = _sample(model, tokenizer, "dynamic", seed), _sample(model, tokenizer, "static", seed)
    _assert_same_sample(dynamic, static)
    assert dynamic.mask.sum(1).min() < dynamic.mask.sum(1).max()  # rows stopped at different steps


def test_the_static_cache_draws_the_same_tokens_under_top_k_and_top_p(gpt2, tokenizer):
    _assert_same_sample(_sample(gpt2, tokenizer, "dynamic", top_k=20, top_p=0.9), _sample(gpt2, tokenizer, "static", top_k=20, top_p=0.9))


def _prefilled(cls, model, tokenizer):
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    positions = (enc["attention_mask"].cumsum(1) - 1).clamp(min=0)
    decoder = cls(model, hidden=True)
    logits, _ = decoder.prefill(enc["input_ids"], enc["attention_mask"], positions, STEPS)
    return decoder, logits


class HostReads(TorchDispatchMode):
    """Records the operators that need a tensor's value on the host (on a GPU: a synchronisation,
    which a CUDA graph capture refuses) or whose output shape depends on values."""

    NAMES = ("_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "unique", "item")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.NAMES:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_the_static_step_reads_nothing_back_and_keeps_its_buffers(model, tokenizer):
    decoder, logits = _prefilled(StaticDecoder, model, tokenizer)
    buffers = [decoder.token, decoder.mask, decoder.position, decoder.slot] + [t for layer in decoder.cache.layers for t in (layer.keys, layer.values)]
    where = [t.data_ptr() for t in buffers]
    for _ in range(3):
        with HostReads() as reads:
            logits, _ = decoder.step(logits.argmax(-1))
        assert reads.seen == []
    assert [t.data_ptr() for t in buffers] == where
    # the detector does see a host read where there is one: for SDPA, the dynamic cache's 2-D
    # mask is turned into a 4-D one at every step by looking at its values
    if model.config._attn_implementation == "sdpa":
        dynamic, logits = _prefilled(DynamicDecoder, model, tokenizer)
        with HostReads() as reads:
            dynamic.step(logits.argmax(-1))
        assert reads.seen != []


@torch.no_grad()
def test_the_static_step_traces_as_one_graph_and_draws_the_same_tokens(model, tokenizer, monkeypatch):
    """fullgraph=True fails on any graph break (a host read, data-dependent control flow): the
    same property a CUDA graph capture needs. The traced step must draw the eager tokens."""
    eager = _sample(model, tokenizer, "static")
    prefill = StaticDecoder.prefill

    def traced_prefill(self, *args):
        first = prefill(self, *args)
        self.forward = torch.compile(self.forward, backend="eager", fullgraph=True, dynamic=False)
        return first

    torch._dynamo.reset()
    monkeypatch.setattr(StaticDecoder, "prefill", traced_prefill)
    _assert_same_sample(eager, _sample(model, tokenizer, "static"))


def _cpu_graph(monkeypatch, replay_from=None):
    """GraphedDecoder on a CPU: the warm-up is the eager step and `replay_from(decoder)` stands in
    for the captured graph (None: the real capture, which fails on a CPU), so that the check, the
    rewind and the fallback run as on a GPU."""
    monkeypatch.setattr(GraphedDecoder, "_warm_up", lambda self: self.forward())
    if replay_from is not None:
        monkeypatch.setattr(GraphedDecoder, "_capture", replay_from)
    monkeypatch.setattr("ppo_lab.decoding.resolve_decode", lambda decode, model, device: (decode, "test"))
    made = []
    monkeypatch.setattr("ppo_lab.sampling.make_decoder", lambda *a, **k: made.append(make_decoder(*a, **k)) or made[-1])
    return made


def test_a_faithful_graph_is_kept_and_draws_the_same_tokens(gpt2, tokenizer, monkeypatch):
    made = _cpu_graph(monkeypatch, lambda self: self.forward)  # a "graph" that runs the step itself
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphed = _sample(gpt2, tokenizer, "cuda_graph")
    assert isinstance(made[0], GraphedDecoder) and made[0].checked and made[0].replay is not False
    _assert_same_sample(_sample(gpt2, tokenizer, "dynamic"), graphed)


def test_a_graph_with_wrong_outputs_is_dropped_and_the_tokens_stay_the_same(gpt2, tokenizer, monkeypatch):
    def wrong(self):
        def replay():
            logits, state = self.forward()  # advances the buffers as the graph would ...
            return logits + 100.0, state  # ... and gets the logits wrong
        return replay

    made = _cpu_graph(monkeypatch, wrong)
    with pytest.warns(RuntimeWarning, match=r"a replay differs from the eager step"):
        graphed = _sample(gpt2, tokenizer, "cuda_graph")
    assert made[0].replay is False
    _assert_same_sample(_sample(gpt2, tokenizer, "dynamic"), graphed)  # the rewind wrote the same cache slots


def test_a_graph_that_froze_its_step_at_capture_is_caught_at_the_second_replay(gpt2, tokenizer, monkeypatch):
    """The classic CUDA-graph bug: a value read on the host at capture is baked into the graph.
    Such a graph is right at its first replay (the state it was captured in) and wrong after."""
    def frozen(self):
        captured = [t.clone() for t in self._state()]

        def replay():
            self._rewind(captured)  # every replay recomputes the captured step
            return self.forward()
        return replay

    made = _cpu_graph(monkeypatch, frozen)
    with pytest.warns(RuntimeWarning, match=r"a replay differs from the eager step"):
        graphed = _sample(gpt2, tokenizer, "cuda_graph")
    assert made[0].replay is False
    _assert_same_sample(_sample(gpt2, tokenizer, "dynamic"), graphed)


def test_a_capture_that_fails_falls_back_to_the_eager_static_step_once_per_model(tokenizer, monkeypatch):
    model = _llama(tokenizer)  # (its own model: a failed capture is remembered per model)
    made = _cpu_graph(monkeypatch)  # the real capture, which a CPU refuses
    with pytest.warns(RuntimeWarning, match=r"capturing the decode step failed"):
        graphed = _sample(model, tokenizer, "cuda_graph")
    _assert_same_sample(_sample(model, tokenizer, "dynamic"), graphed)
    assert model in GraphedDecoder.failed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not tried, nor warned about, again
        again = _sample(model, tokenizer, "cuda_graph")
    assert made[-1].replay is False
    _assert_same_sample(graphed, again)


def test_the_replay_check_treats_equal_infinities_as_equal_and_nan_as_a_difference():
    from ppo_lab.decoding import _gap

    eager = torch.tensor([[float("-inf"), 2.0, -4.0]])
    assert _gap(eager.clone(), eager) == 0.0
    assert _gap(torch.tensor([[float("-inf"), 2.0, -3.996]]), eager) == pytest.approx(1e-3, rel=1e-3)  # relative to max |finite| = 4
    assert not _gap(torch.tensor([[float("nan"), 2.0, -4.0]]), eager) <= 1.0


def test_auto_picks_the_graph_on_cuda_only_for_a_model_that_supports_a_static_cache(gpt2, tokenizer):
    assert resolve_decode("auto", gpt2, "cpu")[0] == "dynamic"
    assert resolve_decode("auto", gpt2, "cuda")[0] == "cuda_graph"
    assert resolve_decode("static", gpt2, "cpu")[0] == "static"
    sliding = _llama(tokenizer, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    assert "sliding" in static_cache_support(sliding)
    decode, why = resolve_decode("auto", sliding, "cuda")
    assert decode == "dynamic" and "sliding" in why
    with pytest.raises(ValueError, match=r"sampling.decode = 'static': .*sliding.*use sampling.decode = 'dynamic'"):
        resolve_decode("static", sliding, "cpu")
    flash = _llama(tokenizer)
    flash.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in static_cache_support(flash)


def test_the_choice_is_refused_where_it_cannot_run(gpt2):
    with pytest.raises(ValueError, match=r"'cuda_graph' needs a CUDA device \(this run is on cpu\)"):
        resolve_decode("cuda_graph", gpt2, "cpu")
    with pytest.raises(ValueError, match=r"valid values are: 'auto', 'dynamic', 'static', 'cuda_graph'"):
        resolve_decode("fast", gpt2, "cpu")

    class Plain(torch.nn.Module):  # not a transformers model: no static cache
        config = gpt2.config

    assert "does not support a static KV cache" in static_cache_support(Plain())
    with pytest.raises(ValueError, match=r"valid values are: 'auto', 'dynamic', 'static', 'cuda_graph'"):
        Sampling(decode="graph")


def test_the_trainer_settles_auto_at_start_and_refuses_a_graph_on_cpu(tiny_path, tmp_path):
    from conftest import small_config
    from ppo_lab.trainer import PPOTrainer

    trainer = PPOTrainer(small_config(tmp_path, {"sampling.decode": "auto", "run.iterations": 1}))
    assert trainer.sampling.decode == "dynamic" and trainer.config.sampling.decode == "auto"
    with pytest.raises(ValueError, match=r"'cuda_graph' needs a CUDA device"):
        PPOTrainer(small_config(tmp_path, {"sampling.decode": "cuda_graph", "run.output_dir": str(tmp_path / "other")}))
