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


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_cuda_graph_decode_is_kept_and_draws_the_tokens_of_the_eager_step(tiny_path, monkeypatch, precision):
    import warnings

    from ppo_lab import decoding
    from ppo_lab.models import load_tokenizer
    from ppo_lab.sampling import Sampling, generate
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval().cuda()
    tokenizer = load_tokenizer(tiny_path)
    tokenizer.padding_side = "left"
    prompts = ["the movie was", "i think this film is really", "2 + 3 =", "the"] * 16
    uniforms = torch.rand(len(prompts), 24, generator=torch.Generator().manual_seed(0))
    made = []
    make = decoding.make_decoder
    monkeypatch.setattr("ppo_lab.sampling.make_decoder", lambda *a, **k: made.append(make(*a, **k)) or made[-1])
    samples = {}
    for decode in ("dynamic", "static", "cuda_graph"):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=r"sampling.decode")  # a dropped graph warns
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                samples[decode] = generate(model, tokenizer, prompts, Sampling(max_new_tokens=24, stop_ids=(tokenizer.eos_token_id,), decode=decode), uniforms=uniforms, with_logprobs=True)
    assert isinstance(made[-1], decoding.GraphedDecoder) and made[-1].checked and made[-1].replay is not False
    # the graph replays the static step's kernels: the same tokens and log-probs
    assert torch.equal(samples["cuda_graph"].response_ids, samples["static"].response_ids)
    torch.testing.assert_close(samples["cuda_graph"].sampler_logprobs, samples["static"].sampler_logprobs, rtol=0, atol=1e-5)
    if precision == "fp32":  # in bf16 the static and the growing cache round differently
        assert torch.equal(samples["cuda_graph"].response_ids, samples["dynamic"].response_ids)


def test_a_run_with_auto_decode_uses_the_graph_and_trains_evaluates_saves_and_resumes(tiny_path, tmp_path, monkeypatch):
    import warnings

    from ppo_lab import decoding

    made = []
    make = decoding.make_decoder
    monkeypatch.setattr("ppo_lab.sampling.make_decoder", lambda *a, **k: made.append(make(*a, **k)) or made[-1])
    cfg = small_config(tmp_path, {"run.iterations": 2, "memory.precision": "bf16", "sampling.decode": "auto", "run.eval_interval": 1, "run.save_interval": 1})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"sampling.decode")  # a dropped graph warns
        trainer, history, _ = train_evaluate_resume(cfg)
    assert trainer.sampling.decode == "cuda_graph"
    assert made and all(isinstance(d, decoding.GraphedDecoder) and d.checked and d.replay is not False for d in made)
    assert history[0]["objective/kl"] == 0.0
