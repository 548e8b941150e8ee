"""Memory: the tensor tracker, the estimate against measurement, and chunked log-probs.

Chapter 9 states that the estimate is within 25% of the measured peak for the tiny model on
CPU, and that chunked log-probs give the same values with a lower peak; these tests hold both.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig

from conftest import small_config
from ppo_lab.logprobs import chunked_logprobs
from ppo_lab.memory import ModelShape, TensorMemory, estimate_memory, measure_iteration
from ppo_lab.rollout import check_chunkable, response_logprobs
from ppo_lab.trainer import PPOTrainer


def test_tensor_memory_counts_storages_once_and_forgets_freed_ones():
    with TensorMemory() as mem:
        a = torch.zeros(1000)  # 4000 bytes
        assert mem.current == 4000
        view = a[:10].view(2, 5)  # a view shares the storage: not counted again
        a.add_(1)  # in place: same storage
        assert mem.current == 4000
        b = torch.ones(500, dtype=torch.float64)  # 4000 more
        assert mem.current == 8000 and mem.peak == 8000
        del b
        assert mem.current == 4000 and mem.peak == 8000
        del view, a
        assert mem.current == 0


def test_tensor_memory_follows_storages_resized_in_place_as_fsdp2_frees_and_gathers_weights():
    original = torch.UntypedStorage.resize_
    with TensorMemory() as mem:
        t = torch.zeros(1000)
        assert mem.current == 4000
        t.untyped_storage().resize_(0)  # freed, the tensor object kept (FSDP2's reshard)
        assert mem.current == 0
        t.untyped_storage().resize_(4000)  # gathered again into the same storage
        u = torch.zeros(500)
        assert mem.current == 6000 and mem.peak == 6000
        t.untyped_storage().resize_(8000)  # grown: counted at its new size, once
        assert mem.current == 10000
        del t
        assert mem.current == 2000  # its storage died at its last size
        with pytest.raises(RuntimeError, match="already measuring"):
            mem.__enter__()
        del u
    assert torch.UntypedStorage.resize_ is original  # the watch ends with the block


def test_tensor_memory_holds_existing_models_and_optimizer_state():
    model = torch.nn.Linear(100, 10)  # 1010 parameters
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 100)).sum().backward()
    opt.step()  # two moments per parameter (and a step counter per tensor)
    with TensorMemory() as mem:
        mem.hold(model, opt, model)  # held twice: counted once
        assert mem.current >= 4 * 1010 * 4  # weights, gradients, two moments
        assert mem.current < 4 * 1010 * 4 + 64
    with pytest.raises(TypeError, match="tensors, modules and optimizers"):
        TensorMemory().hold("weights")


def _gpt2(vocab=512, n_embd=32, n_layer=2):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=n_embd, n_layer=n_layer, n_head=4, n_positions=128)).eval()


@pytest.mark.parametrize(
    "config",
    [
        GPT2Config(vocab_size=5000, n_embd=64, n_layer=3, n_head=4, n_positions=256),
        GPT2Config(vocab_size=5000, n_embd=64, n_layer=3, n_head=4, n_positions=256, tie_word_embeddings=False),
        LlamaConfig(vocab_size=3000, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    ],
)
def test_model_shape_counts_parameters_from_a_config(config):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    exact = sum(p.numel() for p in model.parameters())
    shape = ModelShape.from_config(config)
    assert shape.params == pytest.approx(exact, rel=0.02)  # biases are left out of the count
    assert ModelShape.of(model).params == exact
    assert shape.mlp == ("gated" if isinstance(config, LlamaConfig) else "gelu_new")


def test_model_shape_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="cannot read"):
        ModelShape.from_config(object())
    with pytest.raises(ValueError, match="mlp"):
        ModelShape(10, 1, 8, 2, 2, 4, 32, 100, mlp="swish")


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"critic.design": "shared", "batch.minibatch": 32, "batch.accumulation_steps": 2},
        {"lora.r": 8},
        {"memory.gradient_checkpointing": True, "loss.entropy_coef": 0.01},
        {"memory.logprob_chunk": 16, "data.task": "arithmetic", "batch.rollout": 32},
        {"memory.precision": "bf16"},  # (the reference's linear weights kept in bf16: memory.frozen_weights auto)
    ],
)
def test_the_estimate_is_within_25_percent_of_the_measured_peak(tiny_path, tmp_path, overrides):
    if overrides.get("lora.r"):
        pytest.importorskip("peft")
    values = {
        "batch.rollout": 64, "batch.minibatch": 16, "sampling.max_new_tokens": 12, "batch.epochs": 1,
        "optim.early_stop_kl": None,
    }
    values.update(overrides)
    trainer = PPOTrainer(small_config(tmp_path, values))
    trainer.iterate()  # AdamW's moments exist from the first step on
    rollout_peak, update_peak, ro = measure_iteration(trainer)
    est = estimate_memory(trainer.config, ModelShape.of(trainer.lm), prompt_len=ro.query_ids.shape[1], response_len=ro.response_ids.shape[1])
    assert sum(est.rollout.values()) == pytest.approx(rollout_peak, rel=0.25)
    assert sum(est.update.values()) == pytest.approx(update_peak, rel=0.25)
    assert est.peak == pytest.approx(max(rollout_peak, update_peak), rel=0.25)


def test_the_estimate_responds_to_each_memory_switch():
    from ppo_lab.config import PPOConfig

    shape = ModelShape.from_config(LlamaConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2))
    base = PPOConfig(**{"batch.rollout": 64, "batch.minibatch": 16, "sampling.max_new_tokens": 512})
    est = lambda cfg, **kw: estimate_memory(cfg, shape, prompt_len=256, **kw)  # noqa: E731
    plain = est(base)
    assert est(PPOConfig(**{**base.to_dict(), "memory.gradient_checkpointing": True})).update["activations"] < plain.update["activations"] / 5
    assert est(PPOConfig(**{**base.to_dict(), "memory.logprob_chunk": 1024})).update["logits"] < plain.update["logits"] / 5
    shared = est(PPOConfig(**{**base.to_dict(), "critic.design": "shared"}))
    lora = est(PPOConfig(**{**base.to_dict(), "critic.design": "shared", "lora.r": 16}))
    assert "reference weights" not in lora.update and lora.update["optimizer state"] < shared.update["optimizer state"] / 50
    sharded = [est(base, processes=8, sharding=s).update for s in ("none", "zero1", "zero2", "zero3")]
    assert sharded[1]["optimizer state"] == plain.update["optimizer state"] // 8
    assert sharded[2]["gradients"] == plain.update["gradients"] // 8 and sharded[1]["gradients"] == plain.update["gradients"]
    assert sharded[3]["policy weights"] == plain.update["policy weights"] // 8
    totals = [sum(u.values()) for u in sharded]
    assert totals == sorted(totals, reverse=True) and totals[3] < totals[0] / 3
    with pytest.raises(ValueError, match="sharding"):
        est(base, sharding="zero4")
    with pytest.raises(ValueError, match="no response for a micro-batch"):
        est(base, processes=32)  # 16 responses per minibatch over 32 processes
    chunked = est(PPOConfig(**{**base.to_dict(), "memory.logprob_chunk": 1024}))
    assert chunked.rollout["scoring logits"] < plain.rollout["scoring logits"] / 5
    # FSDP2: the state split like ZeRO-3, plus the gathered units; the whole policy while sampling
    fsdp2 = est(base, processes=8, sharding="fsdp2")
    assert fsdp2.update["policy weights"] == sharded[3]["policy weights"] and fsdp2.update["optimizer state"] == sharded[3]["optimizer state"]
    assert fsdp2.rollout["gathered weights"] == 4 * shape.params and 0 < fsdp2.update["gathered weights"] < 4 * shape.params
    # frozen weights in bf16 (bf16 compute): the reference's linear layers, or all of it sharded
    bf16 = PPOConfig(**{**base.to_dict(), "memory.precision": "bf16"})
    kept = PPOConfig(**{**base.to_dict(), "memory.precision": "bf16", "memory.frozen_weights": "fp32"})
    assert est(kept).update["reference weights"] - est(bf16).update["reference weights"] == 2 * shape.linear_params
    assert est(bf16, processes=8, sharding="fsdp2").update["reference weights"] == 2 * shape.params // 8
    # autocast caches bf16 copies of the trained weights only (policy and critic), whatever the frozen ones are stored in
    assert est(kept).rollout["bf16 weight copies"] == est(bf16).update["bf16 weight copies"] == 2 * (shape.params + shape.params)


def test_model_shape_splits_a_model_into_its_blocks_root_and_linear_layers():
    """Against the parameters of a real Llama (no biases, so the counts are exact), tied and untied."""
    from transformers import LlamaForCausalLM

    for tied in (True, False):
        config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
        model = LlamaForCausalLM(config)
        shape = ModelShape.of(model)
        assert shape.tied == tied
        assert shape.block_params == sum(p.numel() for p in model.model.layers[0].parameters())
        assert shape.root_params == sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.model.layers.parameters())
        embedding = model.model.embed_tokens.weight
        assert shape.linear_params == sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not embedding)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_logprobs_equal_the_full_logits_values_and_gradients(temperature, chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(3, 9, 16, requires_grad=True)
    ids = torch.randint(0, 50, (3, 9))
    # the slow, obviously correct reference: a full log-softmax
    logp_full = torch.log_softmax(head(hidden) / temperature, -1)
    ref_lp = logp_full.gather(-1, ids[..., None]).squeeze(-1)
    ref_ent = -(logp_full.exp() * logp_full).sum(-1)
    lp, ent = chunked_logprobs(hidden, head, ids, temperature, chunk, with_entropy=True)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-6)
    weights = torch.randn(3, 9)
    g_ref = torch.autograd.grad((ref_lp * weights).sum() + ref_ent.sum(), [hidden, head.weight])
    g = torch.autograd.grad((lp * weights).sum() + ent.sum(), [hidden, head.weight])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_chunked_logprobs_refuse_bad_input():
    head = torch.nn.Linear(4, 5)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(torch.randn(1, 2, 4), head, torch.zeros(1, 2, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match=r"\(B, T, H\)"):
        chunked_logprobs(torch.randn(1, 3, 4), head, torch.zeros(1, 2, dtype=torch.long))


def _step_peak(model, batch, chunk):
    q, qm, r, m = batch
    with TensorMemory() as mem:
        mem.hold(model)
        lp, _, _ = response_logprobs(model, q, qm, r, m, 1.0, chunk_size=chunk)
        (lp * m).sum().backward()
        peak = mem.peak
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return lp.detach(), grads, peak


def test_chunked_logprobs_cut_the_peak_memory_of_a_training_step_at_equal_values():
    model = _gpt2(vocab=8192, n_embd=32)  # logits dominate, as with a real vocabulary
    g = torch.Generator().manual_seed(1)
    q, r = torch.randint(3, 8192, (8, 16), generator=g), torch.randint(3, 8192, (8, 48), generator=g)
    batch = (q, torch.ones_like(q), r, torch.ones_like(r))
    lp_full, grads_full, peak_full = _step_peak(model, batch, None)
    lp_chunk, grads_chunk, peak_chunk = _step_peak(model, batch, 64)
    torch.testing.assert_close(lp_chunk, lp_full, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_chunk, grads_full):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    logits_bytes = 8 * 48 * 8192 * 4
    assert peak_full - peak_chunk > 2 * logits_bytes  # the full logits, their gradient and softmax are gone
    assert peak_chunk < peak_full / 2


def test_a_model_whose_logits_are_not_its_head_is_refused_for_chunking():
    model = _gpt2()
    ids = torch.randint(3, 512, (1, 6))
    check_chunkable(model, ids)  # a plain GPT-2 passes

    def soft_cap(module, args, out):  # Gemma 2 style: logits changed after the head
        out.logits = 5 * torch.tanh(out.logits)
        return out

    model.register_forward_hook(soft_cap)
    with pytest.raises(ValueError, match="memory.logprob_chunk"):
        check_chunkable(model, ids)


def test_a_chunked_run_trains_like_the_unchunked_one(tiny_path, tmp_path):
    runs = []
    for chunk in (None, 5):
        cfg = small_config(tmp_path / str(chunk), {
                "memory.logprob_chunk": chunk, "loss.entropy_coef": 0.01, "run.eval_interval": 1,
                "run.save_interval": 1,
            })
        trainer = PPOTrainer(cfg)
        runs.append(trainer.train())
        assert (tmp_path / str(chunk) / "run" / "checkpoints").is_dir() and (tmp_path / str(chunk) / "run" / "policy").is_dir()
    for a, b in zip(*runs):
        for key in ("reward/score_mean", "loss/policy", "loss/entropy", "objective/kl", "eval/score_mean", "policy/approx_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key


def test_expandable_segments_are_turned_on_for_cuda_unless_the_user_configured_the_allocator(monkeypatch):
    from ppo_lab.build import set_cuda_allocator

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert set_cuda_allocator("expandable") is False and calls == []  # nothing to do on a CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert set_cuda_allocator("default") is False and calls == []
    assert set_cuda_allocator("expandable") is True and calls == ["expandable_segments:True"]
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the user's own setting wins, under either name
        monkeypatch.setenv(name, "backend:cudaMallocAsync")
        assert set_cuda_allocator("expandable") is False and calls == ["expandable_segments:True"]
        monkeypatch.delenv(name)


def test_the_readme_quotes_the_fit_table_that_the_estimate_gives():
    """README.md's "what fits" table is `benchmarks/memory_table.py`'s output, and its claims hold:
    full 7-8B training fits 80 GiB only sharded, LoRA at 7-8B fits one GPU."""
    import sys
    from pathlib import Path

    root = Path(__file__).parent.parent
    sys.path.insert(0, str(root / "benchmarks"))
    import memory_table

    table = memory_table.table()
    assert table in (root / "README.md").read_text()
    for name in ("Qwen2.5-7B", "Llama-3-8B"):
        shape = ModelShape.from_config(memory_table.SHAPES[name])
        assert memory_table.peak_gib(shape, "critic + reward model", 1, "none") > 80 > memory_table.peak_gib(shape, "critic + reward model", 8, "fsdp2")
        assert memory_table.peak_gib(shape, "LoRA r=16, value head + reward model", 1, "none") < 80
