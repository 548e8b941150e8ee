"""`memory.frozen_weights`: frozen weights (the reference, a reward model's backbone, a LoRA base)
stored in bf16 where bf16 compute reads them rounded anyway, which changes no output bit."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import small_config, stable
from ppo_lab import PPOConfig, PPOTrainer
from ppo_lab.memory import ModelShape, TensorMemory
from ppo_lab.sharding import frozen_in_bf16


def _llama(tied: bool):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(params=["gpt2", "llama", "llama-tied"])
def model(request, tiny_path):
    if request.param == "gpt2":
        return AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    return _llama(tied=request.param == "llama-tied")


def _logits(model, ids):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=ids).logits


def test_frozen_linear_weights_in_bf16_leave_every_bf16_autocast_output_unchanged(model):
    ids = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    frozen = copy.deepcopy(model).requires_grad_(False)
    converted = frozen_in_bf16(frozen)
    assert torch.equal(_logits(frozen, ids), _logits(model, ids))  # bit for bit
    dtypes = {n: p.dtype for n, p in frozen.named_parameters(remove_duplicate=False)}
    assert dtypes[next(n for n in dtypes if "embed_tokens" in n or "wte" in n)] == torch.float32  # a lookup reads it unrounded
    assert all(d == torch.float32 for n, d in dtypes.items() if "norm" in n or ".ln_" in n)
    if isinstance(model, LlamaForCausalLM):  # (no biases: ModelShape's count is exact)
        assert converted == ModelShape.of(model).linear_params
    # rounding the embeddings too would change the outputs: why only linear layers are stored in bf16
    everything = copy.deepcopy(model).requires_grad_(False)
    frozen_in_bf16(everything, every=True)
    assert not torch.equal(_logits(everything, ids), _logits(model, ids))


def test_trainable_parameters_stay_float32(tiny_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    model.requires_grad_(False)
    trained = model.transformer.h[0].attn.c_attn
    trained.requires_grad_(True)
    frozen_in_bf16(model)
    assert trained.weight.dtype == torch.float32 and model.transformer.h[1].attn.c_attn.weight.dtype == torch.bfloat16


def test_bf16_frozen_weights_need_bf16_compute():
    with pytest.raises(ValueError, match="memory.frozen_weights = 'bf16' needs memory.precision = 'bf16'"):
        PPOConfig(**{"memory.frozen_weights": "bf16"})
    PPOConfig(**{"memory.frozen_weights": "bf16", "memory.precision": "bf16"})


@pytest.mark.parametrize("lora", [0, 4])
def test_a_bf16_run_trains_bit_for_bit_alike_with_frozen_weights_in_bf16_and_holds_less(tiny_path, tiny_reward_path, tmp_path, lora):
    runs = {}
    for frozen in ("fp32", "auto"):
        cfg = small_config(tmp_path / frozen, {"memory.precision": "bf16", "memory.frozen_weights": frozen, "reward.source": str(tiny_reward_path),
                                               "lora.r": lora, "run.eval_interval": 1, "run.eval_count": 2})
        trainer = PPOTrainer(cfg)
        runs[frozen] = (trainer, trainer.train())
    (plain, plain_history), (lean, lean_history) = runs["fp32"], runs["auto"]
    assert [stable(m) for m in lean_history] == [stable(m) for m in plain_history]
    assert lean_history[0]["objective/kl"] == 0.0
    head = lean.reward_fn.model.score
    assert head.weight.dtype == torch.float32  # the score head runs outside autocast: never rounded
    backbone = lean.reward_fn.model.transformer
    assert backbone.h[0].mlp.c_fc.weight.dtype == torch.bfloat16 and backbone.wte.weight.dtype == torch.float32
    held = lambda t: TensorMemory().hold(t.reference, t.policy, t.reward_fn.model).current  # noqa: E731
    shape = ModelShape.of(lean.lm)
    assert held(lean) < held(plain)
    if lora:
        # the base is frozen, the adapter trains in float32; the export merges in float32 into the rounded base
        base = lean.lm.get_base_model().transformer.h[0].attn.c_attn
        assert base.base_layer.weight.dtype == torch.bfloat16 and base.lora_A["default"].weight.dtype == torch.float32
        saved = AutoModelForCausalLM.from_pretrained(lean.output_dir / "policy").state_dict()
        name = "transformer.h.0.attn.c_attn.weight"
        assert saved[name].dtype == torch.float32
        delta = (base.lora_B["default"].weight @ base.lora_A["default"].weight).T * base.scaling["default"]  # (Conv1D: fan_in_fan_out)
        torch.testing.assert_close(saved[name], base.base_layer.weight.float() + delta, rtol=0, atol=1e-6)
    else:
        assert lean.reference.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16
        # the reference's linear weights took half their bytes
        assert TensorMemory().hold(plain.reference).current - TensorMemory().hold(lean.reference).current == pytest.approx(2 * shape.linear_params, rel=0.02)
