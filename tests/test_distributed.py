"""Two processes under `accelerate launch` (CPU, gloo) compute the same run as one process."""

import json
import sys
from pathlib import Path

import pytest

from conftest import assert_same_metrics, launch_two

HERE = Path(__file__).parent


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", ["base", "recipe"])
def test_two_processes_equal_one_with_the_same_global_batch(tiny_path, tmp_path, variant):
    sys.path.insert(0, str(HERE))
    from distributed_run import run

    # 2 processes x 1 micro-batch per minibatch == 1 process x 2 micro-batches: same global
    # rollout (16), minibatch (8) and micro-batch (4), same seed.
    out = tmp_path / "two.json"
    launch_two("distributed_run.py", tmp_path / "run2", 1, out, variant)
    two = json.loads(out.read_text())
    one = run(str(tmp_path / "run1"), 2, variant)

    assert two["processes"] == 2 and one["processes"] == 1
    # metrics are reduced over processes: the losses, clip fractions, whitened advantages, KL
    # and the adaptive controller agree with the single process to float32 round-off
    assert_same_metrics(one["history"], two["history"], 2)
    assert two["kl_coef"] == pytest.approx(one["kl_coef"], rel=1e-6)
    assert two["score_map"] == pytest.approx(one["score_map"], rel=1e-6)
    assert (one["score_map"] != [1.0, 0.0]) == (variant == "recipe")
    for name, value in one["weights"].items():
        assert two["weights"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def _one_update(out_dir, accumulation):
    import torch

    from ppo_lab import PPOConfig, PPOTrainer

    torch.set_num_threads(1)
    cfg = PPOConfig(**{
            "batch.rollout": 16, "batch.minibatch": 8, "batch.epochs": 2, "sampling.max_new_tokens": 8,
            "run.iterations": 1, "run.eval_interval": 0, "run.progress_bar": False, "run.output_dir": out_dir,
            "batch.accumulation_steps": accumulation,
        })
    trainer = PPOTrainer(cfg)
    history = trainer.train()
    if trainer.accelerator.is_main_process:
        weights = trainer.accelerator.unwrap_model(trainer.policy).state_dict()
        result = {"processes": trainer.accelerator.num_processes, "loss": history[-1]["loss/policy"], "weights": {k: v.double().sum().item() for k, v in weights.items()}}
        Path(out_dir, "result.json").write_text(json.dumps(result))


@pytest.mark.timeout(300)
def test_launch_processes_forks_a_group_that_computes_what_one_process_does(tiny_path, tmp_path):
    from ppo_lab.distributed import launch_processes

    _one_update(str(tmp_path / "one"), 2)  # this process now has an Accelerator, as a notebook would: no refusal
    launch_processes(_one_update, (str(tmp_path / "two"), 1), num_processes=2)
    one, two = (json.loads((tmp_path / d / "result.json").read_text()) for d in ("one", "two"))
    assert (one["processes"], two["processes"]) == (1, 2)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    for name, value in one["weights"].items():
        assert two["weights"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    with pytest.raises(ValueError, match="2 or more"):
        launch_processes(_one_update, (), num_processes=1)
