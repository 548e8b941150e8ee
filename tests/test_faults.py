"""Runs that survive faults: atomic checkpoints, exact resume, corruption, nan guards."""

import json
import math
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import small_config, stable
from ppo_lab import checkpoint as ckpt
from ppo_lab.trainer import NonFiniteError, PPOTrainer


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(4, 3, generator=g)
    tensors = {"model": {"a": shared, "tied": shared, "b": torch.randn(5, generator=g)}}
    objects = {"opt": {"state": {0: {"exp_avg": torch.ones(2), "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}
    return tensors, objects, {"iteration": seed, "history": [{"x": 1.5}]}


# --- the checkpoint module ---------------------------------------------------------------------
def test_round_trip_restores_tensors_objects_state_and_ties(tmp_path):
    tensors, objects, state = _state()
    path = ckpt.save_checkpoint(tmp_path, 7, tensors, objects, state)
    assert path.name == "checkpoint-000007"
    t, o, s = ckpt.load_checkpoint(path)
    assert set(t["model"]) == {"a", "tied", "b"}
    for k in ("a", "tied", "b"):
        assert torch.equal(t["model"][k], tensors["model"][k])
    assert torch.equal(o["opt"]["state"][0]["exp_avg"], torch.ones(2)) and o["opt"]["param_groups"][0]["lr"] == 0.1
    assert s == state
    # the tied tensor was written once
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["aliases"]["model"] == {"tied": "a"}


def test_keeps_only_the_newest_n_and_lists_newest_first(tmp_path):
    for it in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, it, *_state(it), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-000004", "checkpoint-000003"]


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda p: (p / "manifest.json").unlink(), r"is incomplete: it has no manifest.json"),
        (lambda p: (p / "model.safetensors").unlink(), r"is incomplete: model.safetensors is missing"),
        (lambda p: _truncate(p / "opt.pt"), r"is corrupted: opt.pt has \d+ bytes, the manifest says \d+"),
        (lambda p: _flip_byte(p / "model.safetensors"), r"is corrupted: the sha256 of model.safetensors"),
        (lambda p: (p / "manifest.json").write_text("{not json"), r"has an unreadable manifest.json"),
    ],
)
def test_damaged_checkpoints_are_named_and_the_previous_one_is_used(tmp_path, damage, match):
    ckpt.save_checkpoint(tmp_path, 1, *_state(1))
    newest = ckpt.save_checkpoint(tmp_path, 2, *_state(2))
    damage(newest)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.load_checkpoint(newest)
    with pytest.warns(UserWarning, match=match + r".*using the previous checkpoint"):
        assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint-000001"


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_pickled_code_in_a_checkpoint_is_refused(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, *_state())
    # A hand-crafted optimizer file holding an arbitrary object, with a manifest that matches it.
    torch.save({"payload": Path("/")}, path / "opt.pt")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["opt.pt"] = {"bytes": (path / "opt.pt").stat().st_size, "sha256": ckpt._sha256(path / "opt.pt")}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match=r"[Ww]eights only load failed|Unsupported global"):
        ckpt.load_checkpoint(path)


_KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from ppo_lab import checkpoint as ckpt

    root, flag = Path(sys.argv[1]), Path(sys.argv[2])
    big = {"w": torch.arange(200_000, dtype=torch.float32)}
    ckpt.save_checkpoint(root, 1, {"model": big}, {}, {"iteration": 1})
    real_write = ckpt._write_file

    def slow_write(path, write):  # the second checkpoint stalls after its first file
        real_write(path, write)
        flag.write_text("writing")
        time.sleep(60)

    ckpt._write_file = slow_write
    ckpt.save_checkpoint(root, 2, {"model": big}, {}, {"iteration": 2}, keep=1)
    """
)


def test_sigkill_while_writing_leaves_the_previous_checkpoint_intact(tmp_path):
    root, flag = tmp_path / "checkpoints", tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(root), str(flag)])
    try:
        deadline = time.time() + 120
        while not flag.exists():
            assert proc.poll() is None, "the writer exited before it was killed"
            assert time.time() < deadline, "the writer never reached the second checkpoint"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    # the killed write left only a temporary folder; the first checkpoint is listed and loads
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["checkpoint-000001"]
    assert any(".tmp-" in p.name for p in root.iterdir())
    tensors, _, state = ckpt.load_checkpoint(ckpt.latest_checkpoint(root))
    assert state["iteration"] == 1 and torch.equal(tensors["model"]["w"], torch.arange(200_000, dtype=torch.float32))
    assert ckpt.remove_partial(root) and [p.name for p in root.iterdir()] == ["checkpoint-000001"]


# --- resume --------------------------------------------------------------------------------------
def _config(tmp_path, name, *settings):
    values = {
        "run.iterations": 4, "run.save_interval": 2, "run.keep_checkpoints": 3, "optim.schedule": "linear",
        "kl.control": "adaptive", "kl.horizon": 64,
    }
    return small_config(tmp_path / name, values, *settings)


def test_resume_is_exact(tiny_path, tmp_path):
    from ppo_lab.tasks import get_task

    # 12 prompts for 16 responses an iteration: the prompt order is reshuffled every iteration
    prompts = get_task("sentiment").train_prompts[:12]
    unbroken = [stable(m) for m in PPOTrainer(_config(tmp_path, "a"), train_prompts=prompts).train()]

    first = PPOTrainer(_config(tmp_path, "b"), train_prompts=prompts)
    first.train(2)
    del first  # the process "dies" after the checkpoint of iteration 2
    resumed = PPOTrainer(_config(tmp_path, "b", {"run.resume_from": "latest"}), train_prompts=prompts)
    assert resumed.iteration == 2 and resumed.resumed_from.name == "checkpoint-000002"
    history = [stable(m) for m in resumed.train()]
    assert len(history) == 4 and history == unbroken  # every metric of every later update, exactly
    # the log file holds each iteration once
    rows = [json.loads(line) for line in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]


def test_resume_drops_log_rows_after_the_checkpoint_and_falls_back_past_a_corrupted_one(tiny_path, tmp_path):
    run = PPOTrainer(_config(tmp_path, "a", {"run.iterations": 4, "run.save_interval": 1}))
    run.train()
    newest = run.output_dir / "checkpoints" / "checkpoint-000004"
    _flip_byte(newest / "policy.safetensors")
    with pytest.warns(UserWarning, match=r"checkpoint-000004' is corrupted: the sha256 of policy.safetensors"):
        resumed = PPOTrainer(_config(tmp_path, "a", {"run.iterations": 4, "run.save_interval": 1, "run.resume_from": "latest"}))
    assert resumed.iteration == 3
    assert [stable(m) for m in resumed.history] == [stable(m) for m in run.history[:3]]
    resumed.train(0)
    rows = [json.loads(line)["iteration"] for line in (run.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]


def test_resume_from_nothing_is_a_clear_error(tiny_path, tmp_path):
    with pytest.raises(ValueError, match=r"no valid checkpoint to resume from in .*checkpoints"):
        PPOTrainer(_config(tmp_path, "a", {"run.resume_from": "latest"}))


def test_resume_with_a_different_config_warns(tiny_path, tmp_path):
    PPOTrainer(_config(tmp_path, "a", {"run.iterations": 2})).train()
    with pytest.warns(UserWarning, match=r"different configuration \(loss.clip_eps: 0.2 -> 0.3\)"):
        PPOTrainer(_config(tmp_path, "a", {"run.iterations": 2, "loss.clip_eps": 0.3, "run.resume_from": "latest"}))


# --- non-finite values -------------------------------------------------------------------------
def test_a_nan_reward_skips_the_update_and_stops_the_run_with_the_checkpoint_untouched(tiny_path, tmp_path):
    calls = {"n": 0}

    def reward(prompts, responses):
        calls["n"] += 1
        bad = calls["n"] >= 3  # iterations 3, 4, ... return nan for one response
        return [math.nan if bad and i == 5 else float(len(r)) / 10 for i, r in enumerate(responses)]

    cfg = _config(tmp_path, "a", {"run.iterations": 10, "run.save_interval": 1, "run.keep_checkpoints": 5, "run.max_bad_updates": 2})
    trainer = PPOTrainer(cfg, reward_fn=reward)
    with pytest.warns(RuntimeWarning, match=r"iteration 3: update skipped \(1 of at most 2\): non-finite reward \(reward/score_mean: reward .* returned \[nan\] for responses \[5\]\)"):
        with pytest.raises(NonFiniteError, match=r"iteration 4: update skipped \(2 of at most 2\).*Stopping: run.max_bad_updates = 2 reached; the newest checkpoint is .*checkpoint-000002"):
            trainer.train()
    # no checkpoint was written after the bad iterations, and the weights never changed after 2
    assert [p.name for p in ckpt.list_checkpoints(trainer.output_dir / "checkpoints")] == ["checkpoint-000002", "checkpoint-000001"]
    tensors, _, state = ckpt.load_checkpoint(trainer.output_dir / "checkpoints" / "checkpoint-000002")
    now = trainer.accelerator.unwrap_model(trainer.policy).state_dict()
    assert all(torch.equal(now[k], v) for k, v in tensors["policy"].items())
    rows = [json.loads(line) for line in (trainer.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped_updates"] for r in rows] == [0.0, 0.0, 1.0, 1.0]
    assert rows[2]["reward/score_mean"] is None  # nan is written as null, never as a number


def test_nan_gradients_skip_the_optimizer_step(tiny_path, tmp_path):
    trainer = PPOTrainer(_config(tmp_path, "a", {"run.iterations": 1, "run.save_interval": 0}))
    before = {k: v.clone() for k, v in trainer.accelerator.unwrap_model(trainer.policy).state_dict().items()}
    lm_head = trainer.lm.get_output_embeddings()
    hook = lm_head.register_forward_hook(lambda module, args, out: out * math.nan if torch.is_grad_enabled() else out)
    with pytest.warns(RuntimeWarning, match=r"non-finite gradients \(policy/grad_norm: nan; non-finite: .*loss/policy"):
        metrics = trainer.iterate()
    hook.remove()
    assert metrics["train/skipped_updates"] == 1.0 and trainer.health.bad_updates == 1
    after = trainer.accelerator.unwrap_model(trainer.policy).state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert not trainer.optimizer.state  # AdamW never took a step


def test_check_scores_can_let_nan_through_for_the_trainer():
    from ppo_lab.rewards import check_scores

    with pytest.raises(ValueError, match=r"returned nan or inf for response\(s\) \[1\]"):
        check_scores([0.0, math.nan], 2)
    assert math.isnan(check_scores([0.0, math.nan], 2, finite=False)[1])
    with pytest.raises(ValueError, match=r"shape \(1,\) for 2 responses"):
        check_scores([math.nan], 2, finite=False)


def test_a_checkpoint_of_an_earlier_version_is_refused_by_name_and_left_intact(tiny_path, tmp_path):
    import dataclasses

    cfg = small_config(tmp_path, {"run.iterations": 1, "run.save_interval": 1})
    PPOTrainer(cfg).train()
    path = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    tensors, objects, state = ckpt.load_checkpoint(path)
    state.pop("prompts")  # the earlier layout kept prompt_order / prompt_rng instead
    old = ckpt.save_checkpoint(tmp_path / "old", 1, tensors, objects, {**state, "prompt_order": [], "prompt_rng": []}, keep=2)
    with pytest.raises(ValueError, match=r"written by an earlier version of ppo_lab .* weights are intact"):
        PPOTrainer(cfg.replace({"run.output_dir": str(tmp_path / "again"), "run.resume_from": str(old)}))
    assert ckpt.verify_checkpoint(old)
