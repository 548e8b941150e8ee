import os

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


def small_config(tmp_path, **overrides):
    """A PPOConfig small enough for a test to run a few iterations in seconds."""
    from ppo_lab.config import PPOConfig

    values = dict(
        rollout_batch_size=16,
        minibatch_size=8,
        ppo_epochs=2,
        max_new_tokens=8,
        total_iterations=2,
        eval_interval=0,
        progress_bar=False,
        output_dir=str(tmp_path / "run"),
    )
    values.update(overrides)
    return PPOConfig(**values)


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
