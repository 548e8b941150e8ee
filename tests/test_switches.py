"""Trainer switches have the effect they name, and switching them off removes it.

A mutation check planted each bug in turn (gradient clipping skipped inside the trainer,
whitening ignored, LoRA dropout left on) and no test noticed; these do.
"""

import pytest
import torch

from conftest import small_config
from ppo_lab.masked import masked_mean, masked_var
from ppo_lab.trainer import PPOTrainer


def _grad_norms_at_step(trainer):
    """The total gradient norm each optimizer step actually applies."""
    seen = []
    step = trainer.optimizer.step

    def spy(*args, **kwargs):
        grads = [p.grad for p in trainer.trained_parameters() if p.grad is not None]
        seen.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
        return step(*args, **kwargs)

    trainer.optimizer.step = spy
    return seen


@pytest.mark.parametrize("max_grad_norm", [0.01, None])
def test_gradient_clipping_bounds_the_applied_gradient(tiny_path, tmp_path, max_grad_norm):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "optim.max_grad_norm": max_grad_norm, "optim.early_stop_kl": None}))
    applied = _grad_norms_at_step(trainer)
    metrics = trainer.iterate()
    assert len(applied) == metrics["policy/steps"] == 4
    if max_grad_norm is None:
        assert min(applied) > 0.01  # the unclipped gradients are larger than the bound below ...
        assert sum(applied) / len(applied) == pytest.approx(metrics["policy/grad_norm"], rel=1e-4)  # ... and reported as is
    else:
        assert max(applied) <= 0.01 * (1 + 1e-4)  # ... and clipped to it
        assert metrics["policy/grad_norm"] > 0.01  # the metric is the norm before clipping


@pytest.mark.parametrize("whiten", [True, False])
def test_whitening_normalises_the_advantages_the_update_uses(tiny_path, tmp_path, whiten):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "advantage.whiten": whiten}))
    ro = trainer.rollout(trainer.next_prompts())
    rewards, advantages, returns = trainer.advantages(ro)
    raw, _ = trainer.objective.estimator(rewards, ro.mask, values=ro.values, group_ids=ro.group_ids, gamma=trainer.config.advantage.gamma, lam=trainer.config.advantage.lam)
    if whiten:
        assert abs(masked_mean(advantages, ro.mask).item()) < 1e-5
        assert masked_var(advantages, ro.mask).item() == pytest.approx(1.0, abs=1e-3)
        assert abs(masked_mean(raw, ro.mask).item()) > 1e-3  # so whitening changed something
    else:
        torch.testing.assert_close(advantages, raw, rtol=0, atol=0)
    seen = {}
    loss = trainer.minibatch_loss
    trainer.minibatch_loss = lambda ro_, idx, adv, ret: seen.setdefault("advantages", adv) is not None and loss(ro_, idx, adv, ret)
    trainer.update(ro, advantages, returns)
    assert seen["advantages"] is advantages  # the update trains on exactly these


def test_lora_dropout_is_switched_off_so_the_first_step_is_on_policy(tiny_path, tmp_path):
    pytest.importorskip("peft")
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "lora.r": 4, "lora.dropout": 0.3, "optim.early_stop_kl": None}))
    dropouts = [m for m in trainer.lm.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    ro = trainer.rollout(trainer.next_prompts())
    _, advantages, returns = trainer.advantages(ro)
    trainer.set_training(True)
    _, metrics = trainer.minibatch_loss(ro, torch.arange(8), advantages, returns)
    # old log-probs from the sampling loop: equal up to fp32 round-off (dropout 0.3 gives ~1e-2)
    assert metrics["policy/approx_kl"].item() < 1e-9 and abs(metrics["policy/ratio_max"].item() - 1.0) < 1e-5


def _reference_metric_names():
    """The names in the first column of the metrics table, book/reference_metrics.md."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "book" / "reference_metrics.md").read_text()
    table = text.split("# Metrics", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


def test_the_metric_table_lists_exactly_the_emitted_keys(tiny_path, tmp_path):
    import fnmatch

    from test_scale import _emulate_fp16_loss_scaling

    keys = set()
    configs = [
        {
            "run.eval_interval": 1, "optim.clip_scope": "per-model", "sampler.noise": 0.05,
            "sampler.correction": "tis",
        },
        {"critic.design": "shared", "loss.entropy_coef": 0.01, "kl.placement": "loss", "loss.dual_clip": 3.0},
        {
            "loss.policy": "ppo_penalty", "critic.design": "none", "advantage.estimator": "rloo",
            "sampling.responses_per_prompt": 2, "sampling.dynamic": True,
        },
    ]
    gold = lambda prompts, responses: [float(len(r)) for r in responses]  # noqa: E731 (reward/gold_mean, eval/gold_mean)
    for i, overrides in enumerate(configs):
        keys |= set(PPOTrainer(small_config(tmp_path / str(i), {"run.iterations": 1}, overrides), gold_fn=gold if i == 0 else None).train()[-1])
    fp16 = PPOTrainer(small_config(tmp_path / "fp16", {"run.iterations": 1}))
    _emulate_fp16_loss_scaling(fp16, torch.amp.GradScaler("cpu"))
    keys |= set(fp16.iterate())
    names = _reference_metric_names()
    undocumented = sorted(k for k in keys if not any(fnmatch.fnmatch(k, n) for n in names))
    never_emitted = sorted(n for n in names if not any(fnmatch.fnmatch(k, n) for k in keys))
    assert undocumented == [] and never_emitted == []


# --- the critic's switches (chapter 7): each takes effect, and off is the plain run -------------
def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _moved(before, model):
    now = dict(model.named_parameters())
    return max((now[n] - p).abs().max().item() for n, p in before.items())


def test_value_warmup_trains_only_the_critic_for_its_iterations(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "critic.warmup_iterations": 1}))
    lm, critic = _weights(trainer.lm), _weights(trainer.critic)
    first = trainer.iterate()
    assert _moved(lm, trainer.lm) == 0.0 and _moved(critic, trainer.critic) > 0.0
    assert "loss/policy" not in first and "loss/value" in first and first["policy/steps"] >= 1
    second = trainer.iterate()
    assert _moved(lm, trainer.lm) > 0.0 and "loss/policy" in second


def test_a_critic_learning_rate_moves_the_critic_at_its_own_rate(tiny_path, tmp_path):
    moved = {}
    for name, lr in (("same", None), ("slow", 1e-7)):
        trainer = PPOTrainer(small_config(tmp_path / name, {"run.iterations": 1, "critic.lr": lr, "optim.lr": 1e-3}))
        assert [g["lr"] for g in trainer.optimizer.param_groups] == [1e-3, lr or 1e-3]
        lm, critic = _weights(trainer.lm), _weights(trainer.critic)
        trainer.iterate()
        moved[name] = _moved(lm, trainer.lm), _moved(critic, trainer.critic)
    assert moved["slow"][1] < moved["same"][1] / 100  # Adam's step is about lr per weight
    assert moved["slow"][0] == pytest.approx(moved["same"][0], rel=0.5)  # the policy is not slowed


def test_the_shared_value_head_gets_the_critic_learning_rate(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"critic.design": "shared", "critic.lr": 1e-5}))
    head = {id(p) for p in trainer.bare(trainer.policy).v_head.parameters()}
    policy_group, critic_group = trainer.optimizer.param_groups
    assert {id(p) for p in critic_group["params"]} == head and critic_group["lr"] == 1e-5
    assert not head & {id(p) for p in policy_group["params"]}


def test_critic_lam_sets_the_return_targets_and_leaves_the_advantages(tiny_path, tmp_path):
    from ppo_lab import compute_gae

    out = {}
    for name, critic_lam in (("plain", None), ("decoupled", 1.0)):
        trainer = PPOTrainer(small_config(tmp_path / name, {"advantage.lam": 0.9, "critic.lam": critic_lam, "advantage.whiten": False}))
        ro = trainer.rollout(trainer.next_prompts())
        out[name] = ro, *trainer.advantages(ro)
    ro, rewards, advantages, returns = out["decoupled"]
    _, want_returns = compute_gae(rewards, ro.values, ro.mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, want_returns)
    torch.testing.assert_close(advantages, out["plain"][2])  # same rollout (same seed), same lam
    assert (returns - out["plain"][3]).abs().max() > 1e-4  # lambda 1 targets differ from lambda 0.9


def test_mean_pooling_feeds_the_critic_head_the_running_mean(tiny_path, tmp_path):
    from ppo_lab.models import causal_mean_pool
    from ppo_lab.rollout import full_sequence

    trainer = PPOTrainer(small_config(tmp_path, {"critic.pooling": "mean"}))
    ro = trainer.rollout(trainer.next_prompts())
    critic = trainer.bare(trainer.critic)
    ids, attention, positions = full_sequence(ro.query_ids, ro.query_mask, ro.response_ids, ro.mask)
    with torch.no_grad():
        hidden = critic.backbone(input_ids=ids, attention_mask=attention, position_ids=positions).last_hidden_state
        want = critic.head(causal_mean_pool(hidden, attention)).squeeze(-1)[:, ro.query_ids.shape[1] - 1 : -1]
    real = ro.mask.bool()
    torch.testing.assert_close(ro.values[real], want[real], rtol=1e-5, atol=1e-5)
    assert PPOTrainer(small_config(tmp_path / "t")).critic.pooling == "token"
    # (a zero-initialised head gives V = bias either way: train a step before comparing)
    critic.head.weight.data.normal_()
    assert not torch.allclose(critic.head(causal_mean_pool(hidden, attention)), critic.head(hidden))


def test_value_warmup_runs_no_policy_forward_in_its_update(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "critic.warmup_iterations": 1}))
    calls = []
    trainer.lm.register_forward_hook(lambda *a: calls.append(1))
    ro = trainer.rollout(trainer.next_prompts())
    _, advantages, returns = trainer.advantages(ro)
    calls.clear()
    trainer.update(ro, advantages, returns)
    assert calls == []  # the separate critic trains alone: the policy's forward would be wasted
    trainer.iteration = 1  # past the warm-up
    trainer.update(ro, advantages, returns)
    assert calls


def test_the_metrics_guide_lists_exactly_the_reference_metrics():
    """Appendix B's tables name every metric of the table in book/reference_metrics.md (which the
    test above keeps equal to the emitted keys) once, and nothing else."""
    import fnmatch
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "book" / "appendix_b_metrics.md").read_text()
    listed = [re.match(r"\| `([^`]+)`", line).group(1) for line in page.splitlines() if re.match(r"\| `[a-z]", line)]
    assert len(listed) == len(set(listed)), sorted(k for k in listed if listed.count(k) > 1)
    names = _reference_metric_names()
    assert sorted(k for k in listed if not any(fnmatch.fnmatch(k, n) for n in names)) == []
    assert sorted(n for n in names if not any(fnmatch.fnmatch(k, n) for k in listed)) == []
