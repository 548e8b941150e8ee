"""Helpers of the course's checks: the marks decorator, the submission's package, messages."""

import importlib
import os
from pathlib import Path

import pytest
import torch


def graded(function: str, points: int):
    """Mark a check as worth `points` for `function`; its docstring's first line is the property
    it checks, shown in the report."""

    def mark(test):
        test.graded = {"function": function, "points": points}
        return test

    return mark


def lab(submodule: str | None = None):
    """The submission's ppo_lab, or one of its modules (conftest.py puts the submission's folder
    first on sys.path; this checks that it was the one imported)."""
    module = importlib.import_module("ppo_lab" + (f".{submodule}" if submodule else ""))
    where = Path(importlib.import_module("ppo_lab").__file__).resolve().parents[1]
    expected = Path(os.environ.get("PPO_LAB_COURSE_SUBMISSION", Path(__file__).resolve().parents[1])).resolve()
    if where != expected:
        raise RuntimeError(f"these checks imported ppo_lab from {where}, not from the submission at {expected}")
    return module


def expect(condition: bool, message: str) -> None:
    """Fail the check with `message` (a sentence that teaches) unless `condition` holds."""
    if not condition:
        pytest.fail(message, pytrace=False)


def close(actual, expected, what: str, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Expect two tensors to agree; the message names `what` and the worst position."""
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected)
    expect(actual.shape == expected.shape, f"{what}: expected shape {tuple(expected.shape)}, got {tuple(actual.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    bad = ~torch.isclose(a, e, atol=atol, rtol=rtol) & ~(torch.isnan(a) & torch.isnan(e))
    if bool(bad.any()):
        at = tuple(int(i) for i in torch.nonzero(bad)[0])
        expect(False, f"{what}: at position {at} expected {e[at].item():.6g}, got {a[at].item():.6g} ({int(bad.sum())} of {bad.numel()} entries differ)")


def right_padded(lengths, T):
    """(B, T) float mask of right-padded rows with the given numbers of real tokens."""
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()


# Slow, obviously correct references, shared by the checks of several assignments.

def slow_gae(r, v, mask, gamma, lam):
    """Per row, on its real tokens only: the backward recursion, V = 0 after the last one."""
    adv, ret = torch.zeros_like(r, dtype=torch.float64), torch.zeros_like(r, dtype=torch.float64)
    for b in range(r.shape[0]):
        idx = [t for t in range(r.shape[1]) if mask[b, t] > 0]
        a = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = float(v[b, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            a = float(r[b, t]) + gamma * next_v - float(v[b, t]) + gamma * lam * a
            adv[b, t], ret[b, t] = a, a + float(v[b, t])
    return adv, ret


def slow_whiten(x, mask, shift_mean=True, eps=1e-8):
    real = x[mask > 0].double()
    mean, var = real.mean(), real.var(unbiased=True)
    out = (x.double() - mean) / torch.sqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask > 0, out, torch.zeros_like(out))
