"""The memory and speed switches do what they say: bf16 autocast, gradient checkpointing, compile."""

import pytest
import torch

from conftest import small_config, stable
from ppo_lab.trainer import PPOTrainer


def _blocks(trainer):
    # the MLP inside each block: its forward runs again when the block is recomputed
    return [m.mlp for m in trainer.lm.modules() if type(m).__name__.endswith("Block")]


def _count_block_forwards(trainer):
    """Count calls of each block MLP's forward (module hooks do not fire in a recompute)."""
    calls = {"n": 0}
    restore = []
    for mlp in _blocks(trainer):
        forward = mlp.forward

        def counted(*args, _forward=forward, **kwargs):
            calls["n"] += 1
            return _forward(*args, **kwargs)

        mlp.forward = counted
        restore.append(mlp)
    return calls, restore


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_gradient_checkpointing_recomputes_the_blocks_and_changes_nothing_else(tiny_path, tmp_path, critic):
    runs = {}
    for flag in (False, True):
        trainer = PPOTrainer(small_config(tmp_path / str(flag), total_iterations=1, critic=critic, gradient_checkpointing=flag))
        assert trainer.lm.is_activation_checkpointing is flag
        ro = trainer.rollout(trainer.next_prompts())
        _, adv, ret = trainer.advantages(ro)
        calls, hooks = _count_block_forwards(trainer)
        metrics = trainer.update(ro, adv, ret)
        for mlp in hooks:
            del mlp.forward
        runs[flag] = (calls["n"], metrics)
    steps = 2 * (16 // 8)  # ppo_epochs x minibatches of the small config
    n_blocks = len(_blocks(trainer))
    assert runs[False][0] == steps * n_blocks  # one forward per block per step
    assert runs[True][0] == 2 * steps * n_blocks  # and once more in each backward: really applied
    for key, value in runs[False][1].items():
        assert runs[True][1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_bf16_autocast_keeps_fp32_master_weights_and_fp32_loss_math(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, total_iterations=1, precision="bf16"))
    seen = {}
    head = trainer.lm.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, a, out: seen.update(logits=out.dtype) if torch.is_grad_enabled() else None)
    ro = trainer.rollout(trainer.next_prompts())
    _, adv, ret = trainer.advantages(ro)
    loss, _ = trainer._loss(ro, torch.arange(4), adv, ret)
    hook.remove()
    assert seen["logits"] == torch.bfloat16  # the forward ran under bf16 autocast
    assert loss.dtype == torch.float32  # the PPO math did not
    assert ro.logprobs.dtype == torch.float32 and ro.values.dtype == torch.float32
    metrics = trainer.update(ro, adv, ret)
    assert all(p.dtype == torch.float32 for p in trainer.optimizer.param_groups[0]["params"])
    assert all(v == v for v in metrics.values())


def test_torch_compile_wraps_the_models_that_train(tiny_path, tmp_path):
    # Compiling itself takes minutes on a CPU (see the README for its agreement with eager
    # mode); here: the switch reaches the models that train, and nothing else changes.
    trainer = PPOTrainer(small_config(tmp_path, torch_compile=True))
    assert type(trainer.policy).__name__ == "OptimizedModule" and type(trainer.critic).__name__ == "OptimizedModule"
    assert trainer.lm is trainer.accelerator.unwrap_model(trainer.policy)  # generation runs eagerly
    assert type(trainer.reference).__name__ != "OptimizedModule"


def test_lora_policy_trains_the_adapter_and_its_reference_is_the_adapter_off(tiny_path, tmp_path):
    pytest.importorskip("peft")
    from ppo_lab.models import load_policy
    from ppo_lab.rollout import response_logits

    trainer = PPOTrainer(small_config(tmp_path, total_iterations=2, lora_r=4, learning_rate=1e-2))
    assert list(trainer.reference.parameters()) == []  # no second copy of the model
    trained = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    lora = [p for n, p in trainer.lm.named_parameters() if "lora_" in n]
    assert lora and trained >= {id(p) for p in lora}
    assert all("lora_" in n for n, p in trainer.lm.named_parameters() if id(p) in trained)
    trainer.train()

    ro = trainer._last_rollout
    base = load_policy(str(tiny_path)).eval()
    with torch.no_grad():
        ref, _ = response_logits(trainer.reference, ro.query_ids, ro.query_mask, ro.response_ids, ro.mask)
        want, _ = response_logits(base, ro.query_ids, ro.query_mask, ro.response_ids, ro.mask)
        now, _ = response_logits(trainer.lm, ro.query_ids, ro.query_mask, ro.response_ids, ro.mask)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)  # the adapter is off in the reference
    assert (now - want).abs().max() > 1e-3  # while the policy has moved
    assert trainer.history[-1]["objective/kl"] != 0.0

    folder = trainer.save(tmp_path / "merged")  # merged: loads without peft, as the trained policy
    with torch.no_grad():
        merged, _ = response_logits(load_policy(str(folder)).eval(), ro.query_ids, ro.query_mask, ro.response_ids, ro.mask)
    torch.testing.assert_close(merged, now, atol=1e-4, rtol=1e-4)
