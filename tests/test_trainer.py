import json
import math

import pytest
import torch

import ppo_lab

from conftest import small_config, stable
from ppo_lab.trainer import PPOTrainer

REQUIRED_METRICS = [
    "reward/score_mean", "reward/score_std", "objective/kl", "objective/entropy", "objective/non_score_reward",
    "policy/clipfrac", "policy/approx_kl", "loss/policy", "loss/value", "value/explained_variance",
    "value/clipfrac", "response/length_mean", "kl/coef", "time/rollout", "time/update",
    "perf/tokens_per_s", "perf/peak_memory_mb", "lr",
]  # fmt: skip


def test_same_seed_same_metrics(tiny_path, tmp_path):
    """Same seed, same machine: every metric but the timings is identical."""
    runs = []
    for name in ("a", "b"):
        trainer = PPOTrainer(small_config(tmp_path / name))
        runs.append([stable(m) for m in trainer.train()])
    assert runs[0] == runs[1]
    other = PPOTrainer(small_config(tmp_path / "c", {"run.seed": 1})).train()
    assert [stable(m) for m in other] != runs[0]


def test_metrics_file_has_every_required_name(tiny_path, tmp_path):
    cfg = small_config(tmp_path, {"run.eval_interval": 1, "run.eval_count": 4})
    PPOTrainer(cfg).train()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == 2 and [r["iteration"] for r in rows] == [1, 2]
    for name in REQUIRED_METRICS + ["eval/score_mean"]:
        assert name in rows[0], name
        assert rows[0][name] is None or math.isfinite(rows[0][name])
    samples = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl")]
    assert len(samples) == 8 and {"iteration", "prompt", "response", "score"} <= set(samples[0])
    assert (tmp_path / "run" / "config.yaml").exists()
    assert (tmp_path / "run" / "policy" / "model.safetensors").exists()


def test_gold_fn_is_measured_and_never_trained_on(tiny_path, tmp_path):
    """A gold reward changes nothing the run does: the metrics are those of the same run without
    it; `reward/gold_mean` is the gold mean of each rollout's responses (recorded here as the
    trainer passes them), and evaluation samples carry a "gold" score."""
    seen = []

    def gold(prompts, responses):
        scores = [len(r) / 10.0 for r in responses]
        seen.append(sum(scores) / len(scores))
        return scores

    cfg = {"run.eval_interval": 2, "run.eval_count": 4}
    plain = PPOTrainer(small_config(tmp_path / "a", cfg)).train()
    trainer = PPOTrainer(small_config(tmp_path / "b", cfg), gold_fn=gold)
    tracked = trainer.train()
    drop = {"reward/gold_mean", "eval/gold_mean"}
    assert [stable({k: v for k, v in m.items() if k not in drop}) for m in tracked] == [stable(m) for m in plain]
    # two rollouts, then one evaluation after the second
    assert [m["reward/gold_mean"] for m in tracked] == pytest.approx(seen[:2])
    samples = trainer.evaluate()
    assert all(s["gold"] == pytest.approx(len(s["response"]) / 10.0) for s in samples)
    assert tracked[-1]["eval/gold_mean"] == pytest.approx(seen[2]) and "eval/gold_mean" not in tracked[0]
    with pytest.raises(TypeError, match="gold_fn must be a callable"):
        PPOTrainer(small_config(tmp_path / "c"), gold_fn="vader")
    bad = PPOTrainer(small_config(tmp_path / "d"), gold_fn=lambda ps, rs: [0.0])
    before = {k: v.clone() for k, v in bad.lm.state_dict().items()}
    with pytest.raises(ValueError, match="gold_fn returned scores of shape"):
        bad.iterate()
    assert all(torch.equal(v, before[k]) for k, v in bad.lm.state_dict().items())  # failed before the update


def test_the_first_update_step_is_on_policy(tiny_path, tmp_path):
    """Before any optimizer step, the policy's log-probs equal the rollout's: ratio 1 exactly
    when the rollout's log-probs come from the same forward as the update's."""
    trainer = PPOTrainer(small_config(tmp_path, {"sampler.old_logprobs_from": "forward"}))
    ro = trainer.rollout(trainer.next_prompts())
    _, advantages, returns = trainer.advantages(ro)
    with torch.no_grad():
        _, metrics = trainer.minibatch_loss(ro, torch.arange(8), advantages, returns)
    assert metrics["policy/approx_kl"].item() == 0.0
    assert metrics["policy/clipfrac"].item() == 0.0
    assert metrics["policy/ratio_min"].item() == metrics["policy/ratio_max"].item() == 1.0


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_log_probs_and_values_from_the_sampling_loop_match_a_forward(tiny_path, tmp_path, critic):
    """The default in fp32: the rollout's log-probs, entropies and (shared head) values come from
    the sampling loop; they agree with a full forward to float32 round-off, so the first step
    is on-policy to ~1e-6."""
    trainer = PPOTrainer(small_config(tmp_path, {"critic.design": critic}))
    assert trainer.sampler.old_logprobs_from == "sampling"
    if critic == "shared":  # a head that is not zero, so the values say something
        torch.nn.init.normal_(trainer.accelerator.unwrap_model(trainer.policy).v_head.weight)
    ro = trainer.rollout(trainer.next_prompts())
    lp, _, values, entropy = ppo_lab.rollout.score_tokens(
        trainer.policy, trainer.reference, trainer.critic, ro.query_ids, ro.query_mask, ro.response_ids, ro.mask, 1.0
    )
    real = ro.mask.bool()
    torch.testing.assert_close(ro.old_logprobs[real], lp[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(ro.entropy[real], entropy[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(ro.values[real], values[real], atol=1e-5, rtol=1e-5)
    if critic == "shared":
        assert values[real].abs().max() > 1e-2
    _, advantages, returns = trainer.advantages(ro)
    with torch.no_grad():
        _, metrics = trainer.minibatch_loss(ro, torch.arange(8), advantages, returns)
    assert metrics["policy/clipfrac"].item() == 0.0
    assert abs(metrics["policy/ratio_min"].item() - 1) < 1e-5 and abs(metrics["policy/ratio_max"].item() - 1) < 1e-5


def test_training_changes_the_policy_not_the_reference(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1}))
    before = {k: v.clone() for k, v in trainer.lm.state_dict().items()}
    ref_before = {k: v.clone() for k, v in trainer.reference.state_dict().items()}
    trainer.train()
    after = trainer.lm.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(ref_before[k], v) for k, v in trainer.reference.state_dict().items())


def test_default_task_score_rises_with_bounded_kl(tiny_path, tmp_path):
    """The default sentiment run: the VADER score climbs well above its start, the KL stays small."""
    from ppo_lab.config import PPOConfig

    cfg = PPOConfig(**{
            "run.iterations": 25, "run.eval_interval": 0, "run.progress_bar": False,
            "run.output_dir": str(tmp_path / "run"),
        })
    history = PPOTrainer(cfg).train()
    start = sum(m["reward/score_mean"] for m in history[:3]) / 3
    end = sum(m["reward/score_mean"] for m in history[-5:]) / 5
    assert end > start + 0.3, (start, end)
    assert max(m["objective/kl"] for m in history[-5:]) < 10.0


@pytest.mark.parametrize(
    "overrides",
    [
        {"critic.design": "shared"},
        {
            "critic.design": "none", "advantage.estimator": "grpo", "sampling.responses_per_prompt": 4,
            "kl.placement": "loss", "kl.estimator": "k3",
        },
        {"critic.design": "none", "advantage.estimator": "rloo", "sampling.responses_per_prompt": 2},
        {
            "critic.design": "separate", "advantage.estimator": "reinforce", "batch.accumulation_steps": 2,
            "loss.entropy_coef": 0.01,
        },
        {
            "kl.control": "adaptive", "kl.target": 1.0, "kl.horizon": 100, "reward.clip": 0.5,
            "reward.normalize": True, "reward.truncated_penalty": 1.0,
        },
        {
            "loss.dual_clip": 3.0, "loss.clip_eps_high": 0.28, "critic.clip": None,
            "loss.aggregation": "seq-mean-token-mean", "optim.schedule": "cosine", "optim.warmup_steps": 1,
        },
        {
            "sampling.stop_token": ".", "sampling.top_k": 20, "sampling.top_p": 0.9,
            "sampling.temperature": 0.7, "optim.max_grad_norm": None, "advantage.whiten": False,
        },
    ],
)
def test_configurations_run(tiny_path, tmp_path, overrides):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1}, overrides))
    (metrics,) = trainer.train()
    assert math.isfinite(metrics["loss/policy"])
    if overrides.get("critic.design") == "none":
        assert "loss/value" not in metrics
    else:
        assert math.isfinite(metrics["loss/value"])
    if overrides.get("kl.control") == "adaptive":
        assert trainer.kl_ctl.value != 0.2


def test_stop_token_cuts_responses(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"sampling.stop_token": ".", "sampling.max_new_tokens": 12}))
    ro = trainer.rollout(trainer.next_prompts())
    dot = trainer.tokenizer.convert_tokens_to_ids(".")
    for ids, mask in zip(ro.response_ids, ro.mask):
        real = ids[mask.bool()].tolist()
        stops = [i for i, t in enumerate(real) if t in (dot, trainer.tokenizer.eos_token_id)]
        assert stops == [] or stops == [len(real) - 1]  # a stop token only at the very end


def test_adaptive_kl_moves_toward_its_target(tiny_path, tmp_path):
    """KL far below target -> beta shrinks; the controller sees one update per iteration."""
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "kl.control": "adaptive", "kl.target": 100.0, "kl.horizon": 50}))
    history = trainer.train()
    assert history[1]["kl/coef"] < history[0]["kl/coef"]


def test_evaluation_does_not_disturb_training(tiny_path, tmp_path):
    a = PPOTrainer(small_config(tmp_path / "a"))
    a.evaluate(4)
    with_eval = [stable(m) for m in a.train()]
    without = [stable(m) for m in PPOTrainer(small_config(tmp_path / "b")).train()]
    assert with_eval == without


def test_an_existing_run_is_never_overwritten_by_accident(tiny_path, tmp_path):
    PPOTrainer(small_config(tmp_path, {"run.iterations": 1})).train()
    first = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"already holds a run \(metrics.jsonl\); choose another run.output_dir, set run.overwrite"):
        PPOTrainer(small_config(tmp_path, {"run.iterations": 1})).train()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == first
    PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "run.overwrite": True})).train()
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1


def test_arithmetic_task_has_a_verifiable_reward(tiny_path, tmp_path):
    """The built-in model solves some additions but not all, and GRPO trains on it."""
    from ppo_lab.tasks import ArithmeticTask

    task = ArithmeticTask()
    assert task.reward(["1 2 + 7 =", "3 + 4 ="], ["1 9", "8"]) == [1.0, 0.0]
    assert set(task.train_prompts).isdisjoint(task.eval_prompts)
    cfg = small_config(tmp_path, {
            "data.task": "arithmetic", "critic.design": "none", "advantage.estimator": "grpo",
            "sampling.responses_per_prompt": 4, "batch.rollout": 32, "sampling.temperature": 0.7,
        })
    trainer = PPOTrainer(cfg)
    # all 100 eval prompts: the shipped model solves about 9% at temperature 0.7, so 2 or more
    # right fails by chance with probability ~1e-3 on a machine whose draws differ
    accuracy = sum(s["score"] for s in trainer.evaluate(100)) / 100
    assert 0.02 <= accuracy < 0.95
    (m,) = trainer.train(1)
    assert math.isfinite(m["loss/policy"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_fp16_without_a_gpu_is_refused(tmp_path):
    with pytest.raises(ValueError, match="fp16' needs a CUDA GPU"):
        PPOTrainer(small_config(tmp_path, {"memory.precision": "fp16"}))


def test_ppo_penalty_adapts_its_beta(tiny_path, tmp_path):
    """PPO-penalty: KL(old || new) far above a tiny target doubles beta after the iteration."""
    cfg = small_config(tmp_path, {
            "loss.policy": "ppo_penalty", "loss.penalty_beta": 0.5, "loss.penalty_target": 1e-6,
            "run.iterations": 2,
        })
    history = PPOTrainer(cfg).train()
    assert history[0]["policy/penalty_beta"] == 0.5
    assert history[1]["policy/penalty_beta"] == 1.0
    assert history[0]["policy/clipfrac"] == 0.0


def test_target_kl_stops_the_update_of_an_iteration(tiny_path, tmp_path):
    """With a target below any real step, each update stops after its first (on-policy) step;
    without one, or with one no step reaches, it runs every epoch's minibatches, and the
    stopped run ends with other weights."""
    stopped = PPOTrainer(small_config(tmp_path / "a", {"batch.epochs": 3, "optim.early_stop_kl": 1e-12}))
    history = stopped.train()
    assert [m["policy/steps"] for m in history] == [1.0, 1.0]
    assert history[0]["policy/approx_kl"] < 1e-9  # only the on-policy step's metrics are kept
    full = PPOTrainer(small_config(tmp_path / "b", {"batch.epochs": 3, "optim.early_stop_kl": None}))
    assert [m["policy/steps"] for m in full.train()] == [6.0, 6.0]  # 3 epochs x 16 / 8 minibatches
    roomy = PPOTrainer(small_config(tmp_path / "c", {"batch.epochs": 3, "optim.early_stop_kl": 1e6}))
    assert [m["policy/steps"] for m in roomy.train()] == [6.0, 6.0]
    differs = [not torch.equal(p, q) for p, q in zip(stopped.policy.parameters(), full.policy.parameters())]
    assert any(differs)


@pytest.mark.parametrize("value", [0.0, -0.1, float("nan")])
def test_target_kl_must_be_positive(value):
    with pytest.raises(ValueError, match=r"optim.early_stop_kl = .* must be a finite number in \(0, inf\)"):
        ppo_lab.PPOConfig(**{"optim.early_stop_kl": value})


def _step_gradients(config):
    """The gradients (after clipping) of every optimizer step of a one-iteration run."""
    trainer = PPOTrainer(config)
    seen, step = [], trainer.optimizer.step

    def record(*args, **kwargs):
        seen.append(torch.cat([p.grad.detach().flatten() for g in trainer.optimizer.param_groups for p in g["params"] if p.grad is not None]))
        return step(*args, **kwargs)

    trainer.optimizer.step = record
    trainer.train()
    return seen


def test_gradient_accumulation_leaves_the_gradient_unchanged(tiny_path, tmp_path, monkeypatch):
    """One micro-batch of 8 responses and two of 4 give the same gradient at every step: each
    micro-batch's token-mean is weighted by its share of the minibatch's tokens (aggregation.py).
    A mean of micro-batch means, the rule it replaced, weighs the tokens of the shorter half more
    and gives another gradient. (Weights are not compared: Adam's first steps amplify float
    round-off in near-zero gradients.)"""
    peek = PPOTrainer(small_config(tmp_path / "peek", {"run.iterations": 1}))
    ro = peek.rollout(peek.next_prompts())  # the first iteration's rollout (same seed)
    order = torch.randperm(len(ro), generator=ppo_lab.build.draws(peek.config.run.seed, 0, "shuffle"))
    counts = {int(ro.mask[order[i : i + 4]].sum()) for i in range(0, len(ro), 4)}
    assert len(counts) > 1  # the micro-batches hold different numbers of tokens, or the test shows nothing
    runs = {ga: _step_gradients(small_config(tmp_path / str(ga), {"run.iterations": 1, "batch.accumulation_steps": ga, "optim.early_stop_kl": None})) for ga in (1, 2)}
    assert len(runs[1]) == len(runs[2]) > 1
    for one, two in zip(runs[1], runs[2]):
        torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-6)
    monkeypatch.setattr(ppo_lab.optimizer_step, "micro_batch_weight", lambda micro, minibatch, loss_agg, processes: 1.0 / 2)
    local = _step_gradients(small_config(tmp_path / "local", {"run.iterations": 1, "batch.accumulation_steps": 2, "optim.early_stop_kl": None}))
    assert (local[0] - runs[1][0]).abs().max() > 1e-3 * runs[1][0].abs().max()


@pytest.mark.parametrize("every", [1, 3])
def test_reading_the_stop_flags_back_less_often_samples_the_same_responses(tiny_path, tmp_path, monkeypatch, every):
    import ppo_lab.sampling as sampling

    trainer = PPOTrainer(small_config(tmp_path, {"sampling.max_new_tokens": 12}))
    prompts = trainer.next_prompts()
    uniforms = torch.rand(len(prompts), 12, generator=torch.Generator().manual_seed(0))
    sample = lambda: sampling.generate(trainer.lm, trainer.tokenizer, prompts, trainer.sampling, uniforms=uniforms, with_logprobs=True)  # noqa: E731
    usual = sample()
    monkeypatch.setattr(sampling, "READ_BACK_EVERY", every)
    other = sample()
    assert usual.response_ids.shape[1] < 12  # every response stopped before the last token, so the cut matters
    for name in ("response_ids", "mask", "ended", "sampler_logprobs", "entropy"):
        torch.testing.assert_close(getattr(other, name), getattr(usual, name), rtol=0, atol=0, msg=name)
    assert sampling.generate(trainer.lm, trainer.tokenizer, prompts, trainer.sampling, uniforms=uniforms, with_logprobs=True, with_entropy=False).entropy is None
