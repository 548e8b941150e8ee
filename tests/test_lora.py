"""LoRA through peft: the adapter-off reference, the SFT-adapter merge, saving, and bad arguments.

Each test runs the tiny offline GPT-2 on the CPU. The central check is behavioural: after one
optimizer step on the adapter the policy's logits move, and the reference's must still equal
the starting model's. A reference that forgot to switch the adapter off fails it.
"""

import inspect
import json

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

pytest.importorskip("peft")  # in requirements.txt; an optional dependency of the package

from ppo_lab.lora import (  # noqa: E402
    ALL_LINEAR,
    LoRAReference,
    adapter_disabled,
    apply_lora,
    load_maybe_adapter,
    parse_target_modules,
    reference_logits,
    save_lora,
    trainable_parameters,
)
from ppo_lab.models import PolicyWithValueHead, disable_dropout, load_policy, make_reference  # noqa: E402

# float32 closeness: merged weights (W + BA as one matrix) round differently from W x + B(A x).
# Every difference a broken reference would make is above 1e-3.
CLOSE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def seeded():
    """peft draws lora_A from torch's global generator: the same draws in every run."""
    torch.manual_seed(0)


def batch(seed=0, rows=3, length=10, vocab=100):
    """Left-padded (input_ids, attention_mask, position_ids), as the trainer builds them."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (rows, length), generator=g)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    attention_mask[1, :3] = 0  # a shorter prompt, padded on the left
    input_ids[1, :3] = 0
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def train_step(model, inputs, lr=1e-2):
    """One AdamW step on the trainable parameters (Adam's first step moves each by about lr)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    loss = -torch.log_softmax(model(**inputs).logits, -1)[..., 5].mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.fixture
def base(tiny_path):
    return load_policy(str(tiny_path))


@pytest.fixture
def trained(tiny_path):
    """(policy after one step on its adapter, the untouched starting model, inputs)."""
    inputs = batch()
    policy = apply_lora(load_policy(str(tiny_path)), r=4, alpha=8)
    train_step(policy, inputs)
    return policy, load_policy(str(tiny_path)), inputs


# --- arguments -----------------------------------------------------------------------------


def test_parse_target_modules():
    assert parse_target_modules("all-linear") == ALL_LINEAR
    assert parse_target_modules(" All-Linear ") == ALL_LINEAR
    assert parse_target_modules("c_attn, c_proj") == ["c_attn", "c_proj"]
    assert parse_target_modules(["c_fc"]) == ["c_fc"]
    for bad in ["", " , ", []]:
        with pytest.raises(ValueError, match=r"lora.target_modules.*empty"):
            parse_target_modules(bad)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(r=0), r"r \(lora.r\) must be a positive integer; got 0"),
        (dict(r=2.5), r"lora.r.*got 2\.5"),
        (dict(alpha=0), r"alpha \(lora.alpha\) must be a positive finite number"),
        (dict(alpha=float("inf")), r"lora.alpha"),
        (dict(dropout=1.0), r"dropout \(lora.dropout\) must be in \[0, 1\); got 1\.0"),
        (dict(dropout=-0.1), r"lora.dropout"),
        (dict(target_modules="q_proj,c_attn"), r"lora.target_modules.*\['q_proj'\] match no linear module.*c_attn"),
        (dict(target_modules="wte"), r"lora.target_modules.*\['wte'\] match no linear module"),  # an Embedding
        (dict(modules_to_save="v_head"), r"modules_to_save: \['v_head'\] match no module.*lm_head"),
    ],
)
def test_bad_arguments_name_the_field(base, kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_lora(base, **kwargs)


def test_a_second_adapter_is_refused(base):
    """Stacking the PPO adapter on an unmerged SFT adapter would switch both off together."""
    policy = apply_lora(base)
    with pytest.raises(ValueError, match="already carries adapter layers; merge them first"):
        apply_lora(policy.get_base_model())


# --- what the adapter covers ---------------------------------------------------------------


def test_all_linear_targets_every_conv1d_but_not_the_head(base):
    from peft.tuners.lora import Linear as LoraLinear
    from transformers.pytorch_utils import Conv1D

    conv_names = {n for n, m in base.named_modules() if isinstance(m, Conv1D)}
    inputs = batch()
    before = logits(base, inputs)
    policy = apply_lora(base, r=4, alpha=8)
    assert set(policy.peft_config["default"].target_modules) == conv_names
    layers = {n.removeprefix("base_model.model."): m for n, m in policy.named_modules() if isinstance(m, LoraLinear)}
    assert set(layers) == conv_names and all(m.fan_in_fan_out for m in layers.values())
    assert isinstance(policy.get_base_model().lm_head, nn.Linear)  # the output head is left alone
    # B starts at zero: before any update the policy is exactly its base.
    assert torch.equal(logits(policy, inputs), before)


def test_only_adapter_parameters_are_trainable(tiny_path):
    from transformers.pytorch_utils import Conv1D

    model = load_policy(str(tiny_path))
    base_total = sum(p.numel() for p in model.parameters())
    assert trainable_parameters(model) == (base_total, base_total)
    r = 4
    # lora_A is (r, in) and lora_B is (out, r); a Conv1D weight is (in, out).
    adapter = sum(r * sum(m.weight.shape) for m in model.modules() if isinstance(m, Conv1D))
    policy = apply_lora(model, r=r, alpha=8)
    assert trainable_parameters(policy) == (adapter, base_total + adapter)
    assert all("lora_" in n for n, p in policy.named_parameters() if p.requires_grad)
    assert adapter / (base_total + adapter) < 0.1

    with_head = apply_lora(load_policy(str(tiny_path)), r=r, alpha=8, modules_to_save="lm_head")
    head = with_head.get_base_model().config.vocab_size * with_head.get_base_model().config.n_embd
    # GPT-2 ties lm_head to wte: one trainable copy serves both, so it is counted once.
    assert trainable_parameters(with_head) == (adapter + head, base_total + adapter + head)


# --- the reference -------------------------------------------------------------------------


def test_reference_is_the_starting_model_after_a_step(trained):
    policy, start, inputs = trained
    want = logits(start, inputs)
    assert max_diff(logits(policy, inputs), want) > 1e-3  # the step moved the policy
    got = LoRAReference(policy)(**inputs).logits
    torch.testing.assert_close(got, want, **CLOSE)
    torch.testing.assert_close(reference_logits(policy, **inputs), want, **CLOSE)
    assert not got.requires_grad


def test_reference_owns_nothing_and_leaves_the_policy_alone(trained):
    """What a trainer does to a frozen reference must not freeze or switch the shared policy."""
    policy, start, inputs = trained
    wrapped = PolicyWithValueHead(policy)  # the reference finds the peft model inside
    ref = LoRAReference(wrapped)
    assert ref.policy is policy and ref.config is policy.config
    assert list(ref.parameters()) == [] and ref.state_dict() == {}
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    policy.train()
    ref.requires_grad_(False)
    ref.eval()
    assert ref.to("cpu") is ref
    ref(**inputs)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable
    assert all(m.training for m in policy.modules())
    logits_out, values = wrapped(**inputs)
    assert values.shape == inputs["input_ids"].shape and max_diff(logits_out, logits(start, inputs)) > 1e-3


def test_reference_runs_in_eval_mode_and_restores_each_flag(tiny_path):
    """A policy passed in with dropout on (not through load_policy): the reference stays exact."""
    from transformers import AutoModelForCausalLM

    raw = AutoModelForCausalLM.from_pretrained(str(tiny_path))
    assert any(isinstance(m, nn.Dropout) and m.p > 0 for m in raw.modules())
    want = logits(AutoModelForCausalLM.from_pretrained(str(tiny_path)).eval(), batch())
    policy = apply_lora(raw)
    policy.train()
    frozen = policy.get_base_model().transformer.drop
    frozen.eval()  # a submodule left in eval mode on purpose keeps its flag
    ref = LoRAReference(policy)
    first, second = ref(**batch()).logits, ref(**batch()).logits
    assert torch.equal(first, second)
    torch.testing.assert_close(first, want, **CLOSE)
    assert policy.training and not frozen.training
    assert all(m.training for m in policy.modules() if m is not frozen)


class ParametersUsed(TorchFunctionMode):
    """Records the storage of every nn.Parameter that a torch function computes with.

    Bookkeeping is left out: attribute reads (`.shape`, `.data`), `numel()`, and peft's
    `requires_grad_` toggling when it switches the adapter off, none of which make a new tensor.
    """

    def __init__(self):
        super().__init__()
        self.ptrs = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        params = [x for x in _pytree.tree_leaves((args, kwargs)) if isinstance(x, nn.Parameter)]
        if params and getattr(func, "__name__", "") != "__get__" and isinstance(out, torch.Tensor) and not any(out is p for p in params):
            self.ptrs.update(p.data_ptr() for p in params)
        return out


def used_parameters(model, inputs):
    with ParametersUsed() as mode, torch.no_grad():
        model(**inputs)
    return mode.ptrs


def test_the_reference_adds_no_weights_while_make_reference_copies(trained):
    policy, _, inputs = trained
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    adapter_ptrs = {p.data_ptr() for n, p in policy.named_parameters() if "lora_" in n}
    assert adapter_ptrs <= used_parameters(policy, inputs)  # the recorder sees the adapter

    ref_ptrs = used_parameters(LoRAReference(policy), inputs)
    assert ref_ptrs and ref_ptrs <= policy_ptrs  # only weights the policy already holds
    assert not ref_ptrs & adapter_ptrs  # ... and none of the adapter's
    assert sum(p.numel() for p in LoRAReference(policy).parameters()) == 0

    copied = make_reference(policy)
    copy_ptrs = used_parameters(copied, inputs)
    assert copy_ptrs and not copy_ptrs & policy_ptrs  # a deep copy: every weight twice
    assert sum(p.numel() for p in copied.parameters()) == trainable_parameters(policy)[1]


def test_modules_to_save_reference_uses_the_original(tiny_path):
    """peft trains a copy of lm_head; with the adapter off the untouched original must run."""
    inputs = batch()
    start = load_policy(str(tiny_path))
    policy = apply_lora(load_policy(str(tiny_path)), r=4, alpha=8, modules_to_save=["lm_head"])
    wrapper = policy.get_base_model().lm_head
    train_step(policy, inputs)
    copy_weight, original = wrapper.modules_to_save["default"].weight, wrapper.original_module.weight
    assert max_diff(copy_weight, original) > 1e-3 and torch.equal(original, start.lm_head.weight)
    # Training the head alone (no LoRA step) moves the policy too.
    want = logits(start, inputs)
    assert max_diff(logits(policy, inputs), want) > 1e-3
    torch.testing.assert_close(LoRAReference(policy)(**inputs).logits, want, **CLOSE)
    # the tied pair stays tied on both sides: the trained copy is the embedding too
    embed = policy.get_base_model().transformer.wte
    assert embed.modules_to_save["default"].weight is copy_weight
    assert embed.original_module.weight is original


def test_disabling_is_undone_after_an_error_and_when_nested(trained):
    policy, start, inputs = trained
    want, base_logits = logits(policy, inputs), logits(start, inputs)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    policy.train()

    bad = dict(inputs, input_ids=torch.full_like(inputs["input_ids"], 10_000))  # out of the vocabulary
    with pytest.raises(IndexError):
        LoRAReference(policy)(**bad)
    with pytest.raises(RuntimeError, match="inside"):
        with adapter_disabled(policy):
            raise RuntimeError("inside")
    assert torch.equal(logits(policy, inputs), want)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable
    assert all(m.training for m in policy.modules())

    with adapter_disabled(policy):
        with adapter_disabled(policy):
            torch.testing.assert_close(logits(policy, inputs), base_logits, **CLOSE)
        # leaving the inner block (or a reference forward) must not switch the adapter back on
        LoRAReference(policy)(**inputs)
        torch.testing.assert_close(logits(policy, inputs), base_logits, **CLOSE)
    assert torch.equal(logits(policy, inputs), want)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable


def test_lora_dropout_defaults_to_zero_and_keeps_forwards_identical(tiny_path):
    assert inspect.signature(apply_lora).parameters["dropout"].default == 0.0
    inputs = batch()
    policy = apply_lora(load_policy(str(tiny_path)), r=4, alpha=8)
    train_step(policy, inputs)  # B != 0, so the adapter's input (where dropout acts) matters
    policy.train()
    assert torch.equal(logits(policy, inputs), logits(policy, inputs))

    noisy = apply_lora(load_policy(str(tiny_path)), r=4, alpha=8, dropout=0.3)
    train_step(noisy, inputs)
    noisy.train()
    assert max_diff(logits(noisy, inputs), logits(noisy, inputs)) > 1e-4  # ratio != 1 on-policy
    disable_dropout(noisy)  # what the trainer does to every model
    assert torch.equal(logits(noisy, inputs), logits(noisy, inputs))


def test_adapter_gradients_under_activation_checkpointing(tiny_path):
    """Non-reentrant checkpointing (what the trainer enables) recomputes the frozen blocks and
    still gives the adapter exactly the gradients it gets without checkpointing."""

    def adapter_grads(checkpointing):
        torch.manual_seed(0)
        policy = apply_lora(load_policy(str(tiny_path)), r=4, alpha=8)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)  # B = 0 would leave lora_A without a gradient either way
        if checkpointing:
            policy.get_base_model().activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        calls = []
        mlp = policy.get_base_model().transformer.h[0].mlp
        forward = mlp.forward  # wrapped, not hooked: module hooks do not fire in a recompute
        mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
        policy.train()
        policy(**batch(), use_cache=False).logits.logsumexp(-1).mean().backward()
        assert len(calls) == (2 if checkpointing else 1)  # the block really was recomputed
        return {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}

    plain, checkpointed = adapter_grads(False), adapter_grads(True)
    assert plain.keys() == checkpointed.keys() and all(g is not None and g.abs().sum() > 0 for g in checkpointed.values())
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], **CLOSE)


# --- an SFT model that is itself an adapter ------------------------------------------------


@pytest.fixture
def sft_folder(tiny_path, tmp_path):
    """An SFT LoRA adapter on the tiny model, saved as adapter only; returns (folder, its logits)."""
    sft = apply_lora(load_policy(str(tiny_path)), r=4, alpha=8)
    train_step(sft, batch(seed=1), lr=3e-2)
    folder = save_lora(sft, tmp_path / "sft", merged=False)
    return folder, logits(sft, batch())


def test_sft_adapter_is_merged_so_the_reference_is_the_sft_model(sft_folder, tiny_path):
    folder, sft_logits = sft_folder
    inputs = batch()
    start = load_maybe_adapter(str(folder))
    assert not any("lora_" in n for n, _ in start.named_parameters())  # a plain, merged model
    torch.testing.assert_close(logits(start, inputs), sft_logits, **CLOSE)
    base_logits = logits(load_policy(str(tiny_path)), inputs)
    assert max_diff(sft_logits, base_logits) > 1e-2  # a reference of the bare base would be wrong

    policy = apply_lora(start, r=4, alpha=8)
    train_step(policy, inputs)
    assert max_diff(logits(policy, inputs), sft_logits) > 1e-3
    torch.testing.assert_close(LoRAReference(policy)(**inputs).logits, sft_logits, **CLOSE)


def test_ppo_adapter_on_an_sft_adapter_saves_and_reloads(sft_folder, tmp_path):
    folder, _ = sft_folder
    inputs = batch()
    policy = apply_lora(load_maybe_adapter(str(folder)), r=4, alpha=8)
    train_step(policy, inputs)
    saved = save_lora(policy, tmp_path / "ppo", merged=False)
    recorded = json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(folder.resolve())  # the SFT adapter, not the bare base model
    torch.testing.assert_close(logits(load_maybe_adapter(str(saved)), inputs), logits(policy, inputs), **CLOSE)


def test_load_maybe_adapter_of_a_full_model_is_load_policy(tiny_path):
    inputs = batch()
    assert torch.equal(logits(load_maybe_adapter(str(tiny_path)), inputs), logits(load_policy(str(tiny_path)), inputs))
    assert torch.equal(logits(load_maybe_adapter("builtin:tiny"), inputs), logits(load_policy(str(tiny_path)), inputs))
    with pytest.raises(ValueError, match="could not load the policy model from '/nowhere/model'"):
        load_maybe_adapter("/nowhere/model")


def test_bad_adapter_folders_are_clear_errors(sft_folder, tmp_path):
    folder, _ = sft_folder
    config = json.loads((folder / "adapter_config.json").read_text())
    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "adapter_config.json").write_text(json.dumps(dict(config, base_model_name_or_path=str(loop))))
    with pytest.raises(ValueError, match="names itself, directly or through other adapters, as its base model"):
        load_maybe_adapter(str(loop))
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    (orphan / "adapter_config.json").write_text(json.dumps(dict(config, base_model_name_or_path=None)))
    with pytest.raises(ValueError, match=r"does not name its base model \(base_model_name_or_path"):
        load_maybe_adapter(str(orphan))


# --- saving --------------------------------------------------------------------------------


def test_save_adapter_only_is_small_and_reloads(trained, tiny_path, tmp_path):
    policy, _, inputs = trained
    folder = save_lora(policy, tmp_path / "adapter", merged=False)
    assert (folder / "adapter_config.json").exists() and not (folder / "model.safetensors").exists()
    assert (folder / "adapter_model.safetensors").stat().st_size < 0.2 * (tiny_path / "model.safetensors").stat().st_size
    torch.testing.assert_close(logits(load_maybe_adapter(str(folder)), inputs), logits(policy, inputs), **CLOSE)


@pytest.mark.parametrize("modules_to_save", [None, "lm_head"])
def test_save_merged_loads_as_a_plain_model(tiny_path, tmp_path, modules_to_save):
    from transformers import AutoModelForCausalLM

    inputs = batch()
    start = logits(load_policy(str(tiny_path)), inputs)
    policy = apply_lora(load_policy(str(tiny_path)), r=4, alpha=8, modules_to_save=modules_to_save)
    train_step(policy, inputs)
    want = logits(policy, inputs)
    folder = save_lora(policy, tmp_path / "merged", merged=True)
    assert (folder / "model.safetensors").exists() and not (folder / "adapter_config.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(str(folder))
    torch.testing.assert_close(logits(reloaded, inputs), want, **CLOSE)
    # The merge ran on a copy: the policy keeps its adapter and the reference its base.
    assert torch.equal(logits(policy, inputs), want)
    torch.testing.assert_close(LoRAReference(policy)(**inputs).logits, start, **CLOSE)
