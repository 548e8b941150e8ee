"""The memory and speed switches do what they say, and each runs end to end (training,
evaluation, a checkpoint and a resume): bf16 autocast, fp16 loss scaling, gradient
checkpointing, compile; and weights that train are float32 whatever their checkpoint holds."""

import warnings

import pytest
import torch

from conftest import overflow_first_backward, small_config, stable
from ppo_lab.distributed import check_distributed_backend
from ppo_lab.trainer import PPOTrainer


def _end_to_end(config, **kwargs):
    """Train with evaluation and checkpoints, evaluate again, resume from the last checkpoint."""
    trainer = PPOTrainer(config, **kwargs)
    history = trainer.train()
    assert len(history) == config.run.iterations and "eval/score_mean" in history[-1]
    assert len(trainer.evaluate(4)) == 4
    resumed = PPOTrainer(config.__class__(**{**config.to_dict(), "run.resume_from": "latest"}), **kwargs)
    assert resumed.iteration == config.run.iterations
    for (name, a), b in zip(trainer.lm.state_dict().items(), resumed.lm.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    return trainer, history


def _blocks(trainer):
    # the MLP inside each block: its forward runs again when the block is recomputed
    return [m.mlp for m in trainer.lm.modules() if type(m).__name__.endswith("Block")]


def _count_block_forwards(trainer, model=None):
    """Count calls of each block MLP's forward (module hooks do not fire in a recompute)."""
    calls = {"n": 0}
    restore = []
    for mlp in _blocks(trainer) if model is None else [m.mlp for m in model.modules() if type(m).__name__.endswith("Block")]:
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
        trainer = PPOTrainer(small_config(tmp_path / str(flag), {"run.iterations": 1, "critic.design": critic, "memory.gradient_checkpointing": flag}))
        assert trainer.lm.is_activation_checkpointing is flag
        ro = trainer.rollout(trainer.next_prompts())
        _, adv, ret = trainer.advantages(ro)
        calls, hooks = _count_block_forwards(trainer)
        critic_calls, critic_hooks = _count_block_forwards(trainer, trainer.critic) if critic == "separate" else ({"n": 0}, [])
        metrics = trainer.update(ro, adv, ret)
        for mlp in hooks + critic_hooks:
            del mlp.forward
        runs[flag] = (calls["n"], critic_calls["n"], metrics)
    steps = 2 * (16 // 8)  # ppo_epochs x minibatches of the small config
    n_blocks = len(_blocks(trainer))
    critic_blocks = n_blocks if critic == "separate" else 0
    assert runs[False][:2] == (steps * n_blocks, steps * critic_blocks)  # one forward per block per step
    # and once more in each backward: really applied, to the policy and to a separate critic
    assert runs[True][:2] == (2 * steps * n_blocks, 2 * steps * critic_blocks)
    for key, value in runs[False][2].items():
        assert runs[True][2][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_gradient_checkpointing_runs_with_evaluation_checkpoints_and_resume(tiny_path, tmp_path, critic):
    # The update leaves the models in train mode, where checkpointed blocks drop the KV cache:
    # evaluation used to fail at its second decoded token.
    cfg = small_config(tmp_path, {
            "run.iterations": 2, "critic.design": critic, "memory.gradient_checkpointing": True,
            "run.eval_interval": 1, "run.save_interval": 1,
        })
    trainer, _ = _end_to_end(cfg)
    assert not trainer.lm.training  # evaluation switched it back


def test_bf16_autocast_keeps_fp32_master_weights_and_fp32_loss_math(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "memory.precision": "bf16"}))
    seen = {}
    head = trainer.lm.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, a, out: seen.update(logits=out.dtype) if torch.is_grad_enabled() else None)
    ro = trainer.rollout(trainer.next_prompts())
    _, adv, ret = trainer.advantages(ro)
    loss, _ = trainer.minibatch_loss(ro, torch.arange(4), adv, ret)
    hook.remove()
    assert seen["logits"] == torch.bfloat16  # the forward ran under bf16 autocast
    assert loss.dtype == torch.float32  # the PPO math did not
    assert ro.old_logprobs.dtype == torch.float32 and ro.values.dtype == torch.float32
    metrics = trainer.update(ro, adv, ret)
    assert all(p.dtype == torch.float32 for p in trainer.optimizer.param_groups[0]["params"])
    assert all(v == v for v in metrics.values())


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_torch_compile_runs_end_to_end_and_matches_eager_mode(tiny_path, tmp_path, monkeypatch, critic):
    # The "eager" backend traces the same graphs as inductor without generating code, so the
    # wiring is tested in seconds (inductor's agreement with eager mode is in book/guide_scaling.md).
    monkeypatch.setattr("ppo_lab.build.COMPILE_BACKEND", "eager")
    cfg = small_config(tmp_path / "compiled", {
            "run.iterations": 2, "critic.design": critic, "memory.compile": True, "run.eval_interval": 1,
            "run.save_interval": 1,
        })
    trainer, compiled = _end_to_end(cfg)
    assert type(trainer.policy).__name__ == "OptimizedModule"
    assert type(trainer.lm).__name__ != "OptimizedModule"  # generation runs eagerly on the bare LM
    assert type(trainer.reference).__name__ != "OptimizedModule"
    if critic == "separate":
        assert type(trainer.critic).__name__ == "OptimizedModule"
    eager = PPOTrainer(small_config(tmp_path / "eager", {"run.iterations": 2, "critic.design": critic, "run.eval_interval": 1})).train()
    for got, want in zip(compiled, eager):
        for key, value in stable(want).items():
            assert stable(got)[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_lora_policy_trains_the_adapter_and_its_reference_is_the_adapter_off(tiny_path, tmp_path):
    pytest.importorskip("peft")
    from ppo_lab.models import load_policy
    from ppo_lab.rollout import response_logits

    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "lora.r": 4, "optim.lr": 1e-2}))
    assert list(trainer.reference.parameters()) == []  # no second copy of the model
    trained = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    lora = [p for n, p in trainer.lm.named_parameters() if "lora_" in n]
    assert lora and trained >= {id(p) for p in lora}
    assert all("lora_" in n for n, p in trainer.lm.named_parameters() if id(p) in trained)
    trainer.train()

    ro = trainer.rollout(trainer.next_prompts())  # sampled by the trained policy
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


def _bf16_copy(tiny_path, folder):
    from ppo_lab.models import load_policy
    from ppo_lab.models import load_tokenizer

    load_policy(str(tiny_path)).to(torch.bfloat16).save_pretrained(folder)
    load_tokenizer(str(tiny_path)).save_pretrained(folder)
    return str(folder)


def test_a_bf16_checkpoint_trains_in_float32(tiny_path, tmp_path):
    # transformers 5 loads a checkpoint in the dtype it was saved in; AdamW on bf16 weights at a
    # hub-model learning rate rounds nearly every update away.
    folder = _bf16_copy(tiny_path, tmp_path / "bf16")
    from safetensors import safe_open

    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "policy.model": folder, "optim.lr": 1e-6, "optim.early_stop_kl": None}))
    trained = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in trained} == {torch.float32}
    assert {p.dtype for p in trainer.reference.parameters()} == {torch.float32}
    before = {n: p.detach().clone() for n, p in trainer.lm.named_parameters()}
    trainer.train()
    moved = [n for n, p in trainer.lm.named_parameters() if not torch.equal(p, before[n])]
    # every weight moves by about the learning rate; in bf16 (spacing 2^-8 relative) none would
    assert len(moved) == len(before)
    change = max((p - before[n]).abs().max().item() for n, p in trainer.lm.named_parameters())
    assert change < 1e-4


def test_a_bf16_policy_passed_in_is_cast_to_float32_with_a_warning(tiny_path, tmp_path):
    from ppo_lab.models import load_policy

    policy = load_policy(str(tiny_path)).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="bfloat16 weights; cast to float32"):
        trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1}), policy=policy)
    assert {p.dtype for p in trainer.lm.parameters()} == {torch.float32}


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_under_bf16_every_role_runs_in_one_precision_so_the_first_kl_is_zero(tiny_path, tmp_path, critic):
    # The sampling loop, the policy's and the reference's scoring forwards used to run in
    # different precisions (bf16 autocast reached only the prepared models), so the KL to the
    # reference was not 0 before any update.
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "memory.precision": "bf16", "critic.design": critic}))
    ro = trainer.rollout(trainer.next_prompts())
    assert ro.old_logprobs.dtype == torch.float32
    torch.testing.assert_close(ro.old_logprobs, ro.ref_logprobs, rtol=0, atol=0)
    metrics = trainer.iterate()
    assert metrics["objective/kl"] == 0.0


def test_bf16_runs_end_to_end(tiny_path, tmp_path):
    _end_to_end(small_config(tmp_path, {"run.iterations": 2, "memory.precision": "bf16", "run.eval_interval": 1, "run.save_interval": 1}))


def _emulate_fp16_loss_scaling(trainer, scaler):
    """What accelerate sets up for fp16 on a GPU, with a CPU GradScaler (the CPU has no fp16 path).

    The trainer's loop is unchanged: `accelerator.backward` scales the loss, `clip_grad_norm_`
    unscales the gradients, the optimizer wrapper's `step` calls `scaler.step` and `update`.
    """
    from accelerate.optimizer import AcceleratedOptimizer

    trainer.accelerator.scaler = scaler
    trainer.accelerator.unscale_gradients = lambda optimizer=None: scaler.unscale_(trainer.optimizer.optimizer)
    trainer.optimizer = trainer.stepper.optimizer = AcceleratedOptimizer(trainer.optimizer.optimizer, device_placement=False, scaler=scaler)


def test_fp16_overflow_lowers_the_loss_scale_and_training_goes_on(tiny_path, tmp_path):
    # An overflow in the first steps of fp16 training is normal: the scaler skips that step and
    # halves its scale. The trainer used to skip without telling the scaler, and the next
    # unscale raised "unscale_() has already been called on this optimizer since the last update()".
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "optim.early_stop_kl": None}))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _emulate_fp16_loss_scaling(trainer, scaler)
    overflow_first_backward(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an overflow is not a failed update
        metrics = trainer.iterate()
    assert metrics["train/overflow_steps"] == 1.0
    assert metrics["policy/steps"] == 2 * (16 // 8) - 1  # every other minibatch stepped
    assert metrics["train/skipped_updates"] == 0.0 and trainer.health.bad_updates == 0
    assert scaler.get_scale() == 2.0**9  # halved once, by the overflow
    assert all(v == v for v in stable(metrics).values())


def test_fp16_loss_scaling_with_an_early_stop(tiny_path, tmp_path):
    # The target-KL stop drops gradients the scaler has already unscaled; it must tell the scaler.
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "optim.early_stop_kl": 1e-9, "optim.lr": 1e-2}))
    _emulate_fp16_loss_scaling(trainer, torch.amp.GradScaler("cpu", init_scale=2.0**10))
    for _ in range(2):
        metrics = trainer.iterate()
        assert metrics["policy/steps"] == 1.0  # stopped after the first (on-policy) step


@pytest.mark.parametrize("kind", ["FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"])
def test_sharded_backends_are_refused_with_what_is_supported(kind):
    from accelerate.utils import DistributedType

    with pytest.raises(ValueError, match=rf"distributed type {kind} is not supported by ppo_lab: .*set memory.sharding: fsdp2"):
        check_distributed_backend(DistributedType[kind])
    for ok in ("NO", "MULTI_CPU", "MULTI_GPU"):
        check_distributed_backend(DistributedType[ok])


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_scoring_in_chunks_gives_the_same_rollout(tiny_path, tmp_path, critic):
    rollouts = {}
    for size in (None, 3):
        trainer = PPOTrainer(small_config(tmp_path / str(size), {"critic.design": critic, "sampler.old_logprobs_from": "forward", "batch.forward": size}))
        rollouts[size] = trainer.rollout(trainer.next_prompts())
    for name in ("old_logprobs", "ref_logprobs", "values", "entropy"):
        torch.testing.assert_close(getattr(rollouts[3], name), getattr(rollouts[None], name), rtol=1e-5, atol=1e-5, msg=name)


def test_the_trainer_refuses_fsdp_at_start_up(tiny_path, tmp_path, monkeypatch):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: DistributedType.FSDP))
    with pytest.raises(ValueError, match="distributed type FSDP is not supported"):
        PPOTrainer(small_config(tmp_path))


def test_fp16_iteration_where_every_step_overflows_is_not_an_error(tiny_path, tmp_path):
    # No step taken means no approx KL for PPO-penalty's controller: it keeps its beta.
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "loss.policy": "ppo_penalty", "optim.early_stop_kl": None}))
    _emulate_fp16_loss_scaling(trainer, torch.amp.GradScaler("cpu", init_scale=2.0**10))
    beta = trainer.penalty_ctl.value
    next(p for p in trainer.lm.parameters() if p.requires_grad).register_hook(lambda g: torch.full_like(g, float("inf")))
    metrics = trainer.iterate()
    assert metrics["policy/steps"] == 0.0 and metrics["train/overflow_steps"] == 2 * (16 // 8)
    assert trainer.penalty_ctl.value == beta and trainer.health.bad_updates == 0
