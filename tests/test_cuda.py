"""The CUDA-only paths: run where a GPU is present, skipped elsewhere (CI has none).

On a CPU the same loop is tested with a CPU grad scaler and CPU bf16 autocast (test_scale.py);
these check the real thing: accelerate's fp16 scaler and autocast on CUDA, and the per-iteration
peak-memory reading.
"""

import pytest
import torch

from conftest import overflow_first_backward, small_config, train_evaluate_resume
from ppo_lab.distributed import max_peak_memory_mb
from ppo_lab.trainer import PPOTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("critic", ["separate", "shared"])
@pytest.mark.parametrize("scope", ["global", "per-model"])
def test_mixed_precision_on_cuda_trains_evaluates_saves_and_resumes(tiny_path, tmp_path, precision, critic, scope):
    # per-model clipping unscales fp16 gradients once, through accelerate's real scaler
    cfg = small_config(tmp_path, {
            "run.iterations": 3, "memory.precision": precision, "critic.design": critic,
            "run.eval_interval": 1, "run.save_interval": 1, "optim.clip_scope": scope,
        })
    trainer, history, _ = train_evaluate_resume(cfg)
    assert trainer.device.type == "cuda"
    assert (trainer.accelerator.scaler is not None) == (precision == "fp16")
    assert history[0]["objective/kl"] == 0.0  # every role ran in one precision
    assert {p.dtype for g in trainer.optimizer.param_groups for p in g["params"]} == {torch.float32}


def test_fp16_overflow_on_cuda_lowers_the_scale_and_training_goes_on(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "memory.precision": "fp16", "optim.early_stop_kl": None}))
    scale = trainer.accelerator.scaler.get_scale()
    overflow_first_backward(trainer)
    metrics = trainer.iterate()
    assert metrics["train/overflow_steps"] >= 1.0 and trainer.health.bad_updates == 0
    assert trainer.accelerator.scaler.get_scale() < scale


def test_peak_memory_is_per_iteration_on_cuda(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 2}))
    first = trainer.iterate()["perf/peak_memory_mb"]
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 256 MB, freed at once
    del big
    assert torch.cuda.max_memory_allocated() / 2**20 >= 256
    max_peak_memory_mb(trainer.accelerator)  # reads this peak
    second = trainer.iterate()["perf/peak_memory_mb"]
    assert second < first + 256  # the 256 MB spike belonged to no iteration
