"""No combination of the trainer's switches crashes or trains silently wrong.

Every pair of values of the switches below appears together in at least one run (pairwise
covering, from allpairspy, topped up where its greedy search misses a pair): a few dozen runs (`len(CASES)`) instead of the
millions of the full product.
Each run trains 2 iterations with evaluation and a checkpoint after each, then resumes from the
last checkpoint, and must pass `conftest.train_evaluate_resume` (optimizer steps taken, the
trainable weights changed, every metric finite, the same weights after resuming) and start
on-policy (the KL to the reference is 0 before the first update, for the source of the old
log-probs that the trainer's own rule picks). A combination `PPOConfig` refuses is left out (its error is tested
in test_config.py).
"""

import pytest
from allpairspy import AllPairs

from conftest import small_config, train_evaluate_resume
from ppo_lab import PPOConfig
from ppo_lab.sampler import old_logprobs_source

SWITCHES = {
    "critic.design": ["separate", "shared", "none"],
    "advantage.estimator": ["gae", "reinforce", "rloo", "grpo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline"],
    "memory.precision": ["fp32", "bf16"], "memory.gradient_checkpointing": [False, True],
    "memory.compile": [False, True], "lora.r": [0, 4], "loss.policy": ["clip", "ppo_penalty", "gspo", "cispo"],
    "kl.placement": ["reward", "loss"], "kl.estimator": ["k1", "k3"], "kl.control": ["fixed", "adaptive"],
    "sampler.old_logprobs_from": ["auto", "sampling", "forward"], "batch.accumulation_steps": [1, 2],
    "loss.aggregation": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
    "optim.early_stop_kl": [None, 0.1], "optim.max_grad_norm": [None, 1.0], "advantage.whiten": [True, False],
    "batch.forward": [None, 3], "critic.warmup_iterations": [0, 1], "critic.lam": [None, 1.0],
    "critic.lr": [None, 1e-4], "critic.pooling": ["token", "mean"],
    "optim.clip_scope": ["global", "per-model"], "advantage.whiten_rewards": [False, True],
    "reward.truncated_score": [None, -1.0], "reward.reference_norm": ["none", "mean-std"],
    "sampling.stop_after": [0, 3], "memory.logprob_chunk": [None, 5],
    "sampler.correction": ["none", "tis", "mis"], "sampler.noise": [0.0, 0.05],
    "sampling.dynamic": [False, True], "reward.overlong_buffer": [0, 2],
    "advantage.drop_truncated": [False, True], "sampling.decode": ["dynamic", "static"],
    "memory.sharding": ["none", "fsdp2"],  # (fsdp2 in this one process: a world of one)
    "memory.frozen_weights": ["auto", "fp32"],  # (auto: bf16 with memory.precision bf16)
}
BASE = {
    "sampling.responses_per_prompt": 2, "run.iterations": 2, "run.eval_interval": 1, "run.save_interval": 1,
    "optim.lr": 1e-3,
}


def _valid(values) -> bool:
    try:
        PPOConfig(**BASE, **dict(zip(SWITCHES, values)))
    except ValueError:
        return False
    return True


def _completion(a, va, b, vb) -> dict | None:
    """A valid case holding a = va and b = vb (defaults elsewhere), or None if there is none.

    PPOConfig's refusals involve the critic and the estimator only, so trying their values is
    enough."""
    for critic in SWITCHES["critic.design"]:
        for estimator in SWITCHES["advantage.estimator"]:
            values = {n: SWITCHES[n][0] for n in SWITCHES}
            values.update({"critic.design": critic, "advantage.estimator": estimator})
            values.update({a: va, b: vb})
            if _valid(list(values.values())):
                return values
    return None


def _pairs():
    names = list(SWITCHES)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for va in SWITCHES[a]:
                for vb in SWITCHES[b]:
                    yield a, va, b, vb


def _cases() -> list[dict]:
    cases = [dict(zip(SWITCHES, row)) for row in AllPairs(list(SWITCHES.values()), filter_func=_valid)]
    # allpairspy's greedy search can miss a pair when a filter is given: add a case for each
    for a, va, b, vb in _pairs():
        if not any(c[a] == va and c[b] == vb for c in cases) and (extra := _completion(a, va, b, vb)):
            cases.append(extra)
    return cases


CASES = _cases()


def test_the_cases_cover_every_valid_pair():
    for a, va, b, vb in _pairs():
        covered = any(c[a] == va and c[b] == vb for c in CASES)
        assert covered or _completion(a, va, b, vb) is None, (a, va, b, vb)
    assert all(_valid(list(c.values())) for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_a_combination_trains_evaluates_saves_and_resumes(tiny_path, tmp_path, monkeypatch, case):
    monkeypatch.setattr("ppo_lab.build.COMPILE_BACKEND", "eager")  # see test_scale.py
    trainer, history, _ = train_evaluate_resume(small_config(tmp_path, BASE, case))
    # on-policy at the start: the reference is the initial policy. Log-probs from the sampling
    # loop's cached bf16 forward differ from a full forward by ~1e-2 nats (why "auto" avoids them).
    # A sampler that differs from the trainer (sampler.noise) puts its gap into the old log-probs
    # when they come from sampling (the bypass form); auto then picks the trainer's forward.
    source = old_logprobs_source(case["sampler.old_logprobs_from"], case["memory.precision"], case["sampler.noise"] > 0, case["sampler.correction"])
    assert source == trainer.sampler.old_logprobs_from
    if source == "forward":
        assert history[0]["objective/kl"] == 0.0  # the same forward as the reference's
    else:
        assert abs(history[0]["objective/kl"]) < (0.5 if case["memory.precision"] == "bf16" or case["sampler.noise"] > 0 else 1e-4)
    assert trainer.evaluate(2)
