import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One thread: steady timings on a 2-core machine, and no oversubscription if anything else runs.
torch.set_num_threads(1)

SEEDS = [0, 1, 2]
SHAPES = [(1, 1), (3, 7), (8, 16)]
DTYPES = [torch.float32, torch.float64]


def random_mask(B, T, generator, holes=False):
    """(B, T) 0/1 float mask with at least one real token per row.

    holes=False: right-padded responses (a prefix of ones of random length 1..T).
    holes=True: ones anywhere (for checking that masking is position-agnostic).
    """
    if holes:
        mask = (torch.rand(B, T, generator=generator) < 0.6).double()
        empty = mask.sum(-1) == 0
        mask[empty, torch.randint(0, T, (int(empty.sum()),), generator=generator)] = 1.0
        return mask
    lengths = torch.randint(1, T + 1, (B,), generator=generator)
    return (torch.arange(T)[None, :] < lengths[:, None]).double()


def scribble(x, mask, generator, value=None):
    """Copy of `x` with every masked-out position overwritten by junk (or `value`)."""
    junk = torch.randn(x.shape, generator=generator, dtype=torch.float64).to(x.dtype) * 1e3
    if value is not None:
        junk = torch.full_like(x, value)
    return torch.where(mask.bool(), x, junk)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="session")
def tiny_path():
    """The built-in tiny model's folder (built once, then cached like in the book)."""
    from ppo_lab.tiny import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def tiny_reward_path(tiny_path, tmp_path_factory):
    """A decoder reward model (GPT-2 backbone, 1-label score head) on the tiny model, its head
    drawn at seed 0, saved to a local folder."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_path, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    folder = tmp_path_factory.mktemp("reward") / "rm"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def launch_two(script, *args, timeout=540):
    """Run tests/`script` with `args` in 2 CPU processes (gloo) under `accelerate launch`; fail with its stderr."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = Path(__file__).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(here.parent)}
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(port), str(here / script), *map(str, args),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def assert_same_metrics(one: list[dict], two: list[dict], iterations: int) -> None:
    """Two runs' metric rows agree, iteration by iteration, to float32 round-off (timings and memory left out)."""
    assert len(two) == len(one) == iterations
    for a, b in zip(one, two):
        a, b = stable(a), stable(b)
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def small_config(tmp_path, *settings):
    """A PPOConfig small enough for a test to run a few iterations in seconds; `settings`
    (dicts of dotted names, applied in order) override it."""
    from ppo_lab.config import PPOConfig

    values = {
        "batch.rollout": 16, "batch.minibatch": 8, "batch.epochs": 2, "sampling.max_new_tokens": 8,
        "run.iterations": 2, "run.eval_interval": 0, "run.progress_bar": False,
        "run.output_dir": str(tmp_path / "run"),
    }
    return PPOConfig.from_dict(values, *settings)


VOLATILE = ("time/", "perf/")


def stable(metrics):
    """Metrics without wall-clock timings and memory readings (which differ run to run)."""
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


def overflow_first_backward(trainer):
    """Make the first backward pass give one weight an inf gradient (an fp16 overflow)."""
    param = next(p for p in trainer.lm.parameters() if p.requires_grad)
    calls = {"n": 0}

    def overflow_once(grad):
        calls["n"] += 1
        return torch.full_like(grad, float("inf")) if calls["n"] == 1 else grad

    param.register_hook(overflow_once)


def train_evaluate_resume(cfg, **trainer_kwargs):
    """Train `cfg` (evaluating and saving at every iteration), check what every configuration
    must do, resume from its latest checkpoint and check that the resumed run holds exactly the
    trained state. Returns (trainer, history, resumed).

    Checked: one row per iteration, none skipped, an optimizer step in each; every logged metric
    finite; every trainable weight changed; an evaluation logged and the final policy saved;
    after resuming, the iteration, the KL controller, the score map and every weight equal."""
    import dataclasses
    from pathlib import Path

    from ppo_lab.trainer import PPOTrainer

    assert cfg.run.eval_interval == 1 and cfg.run.save_interval == 1, "evaluate and save at every iteration"
    trainer = PPOTrainer(cfg, **trainer_kwargs)
    whole = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731 (a sharded DTensor)
    trainable = {n: whole(p.detach()).clone() for n, p in trainer.bare(trainer.policy).named_parameters() if p.requires_grad}
    history = trainer.train()
    assert [m["iteration"] for m in history] == list(range(1, cfg.run.iterations + 1))
    assert all(m["train/skipped_updates"] == 0.0 and m["policy/steps"] >= 1 for m in history)
    bad = [k for m in history for k, v in stable(m).items() if isinstance(v, float) and not math.isfinite(v)]
    assert not bad, bad
    now = {n: whole(p.detach()) for n, p in trainer.bare(trainer.policy).named_parameters()}
    assert [n for n, p in trainable.items() if torch.equal(now[n], p)] == []
    assert "eval/score_mean" in history[-1] and (Path(cfg.run.output_dir) / "policy").is_dir()
    resumed = PPOTrainer(cfg.replace({"run.resume_from": "latest"}), **trainer_kwargs)
    assert resumed.iteration == cfg.run.iterations and resumed.kl_ctl.value == trainer.kl_ctl.value
    assert (resumed.score_gain, resumed.score_bias) == (trainer.score_gain, trainer.score_bias)
    for role in ("policy", "critic"):
        if getattr(trainer, role) is None:
            continue
        saved, loaded = trainer.bare(getattr(trainer, role)).state_dict(), resumed.bare(getattr(resumed, role)).state_dict()
        assert saved.keys() == loaded.keys(), role
        for name, a in saved.items():
            torch.testing.assert_close(whole(a), whole(loaded[name]).to(a.device), rtol=0, atol=0, msg=f"{role}: {name}")
    return trainer, history, resumed
