"""Argument checks shared by the math modules.

Every public function in `ppo_lab` validates its inputs with these helpers, so a wrong shape, a
mask that is not 0/1 or an out-of-range coefficient fails at the call that received it, with a
`ValueError` that names the argument and says what was expected, instead of broadcasting
silently into a wrong number three functions later.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable

import torch

class NonFiniteError(RuntimeError):
    """A run met nan or inf where it cannot go on: too many updates skipped for non-finite
    rewards, losses or gradients (`run.max_bad_updates`), weights that became non-finite,
    or a model whose logits are nan or inf. `metrics` holds the failed iteration's metrics
    when there are any (the trainer logs them before stopping)."""

    def __init__(self, message: str, metrics: dict | None = None):
        super().__init__(message)
        self.metrics = metrics


# Checks of a tensor's *values* (a mask holds only 0 and 1, has a real token) read the tensor
# back to the host, which on a GPU waits for every queued kernel. The trainer checks each
# rollout's mask once and runs its update inside `skip_value_checks()`, so the loss functions,
# called on every micro-batch, keep their shape checks (free) but not these.
_VALUE_CHECKS = contextvars.ContextVar("ppo_lab_value_checks", default=True)


@contextlib.contextmanager
def skip_value_checks():
    """Inside this block, the checks that read tensor values back to the host are skipped.

    For callers that validated their masks once already (`PPOTrainer` does, once per rollout).
    Shape and argument checks still run.
    """
    token = _VALUE_CHECKS.set(False)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def value_checks_on() -> bool:
    return _VALUE_CHECKS.get()


def check_tensor(name: str, x, ndim: int | None = None) -> torch.Tensor:
    """Return `x` if it is a tensor (of `ndim` dimensions when given), else raise.

    Throughout `ppo_lab` a 2-dimensional tensor is (B, T) and a 3-dimensional one (B, T, V), so
    with ndim=2 or ndim=3 dimension 1 is the response dimension and must not be empty (see
    `check_response_dim`).
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(
            f"`{name}` must have {ndim} dimension(s), got shape {tuple(x.shape)}"
        )
    if ndim in (2, 3):
        check_response_dim(name, x, dim=1)
    return x


def check_float(**tensors: torch.Tensor) -> None:
    """Raise unless every tensor given by keyword has a floating-point dtype.

    For the value arguments of the math (rewards, values, log-probs, advantages, losses, ...):
    integer arithmetic would truncate them silently (an integer `rewards` gives integer
    advantages). Masks are not checked here: `check_mask` converts them. A dtype check reads
    nothing back from the device.
    """
    for name, value in tensors.items():
        check_tensor(name, value)
        if not value.is_floating_point():
            raise ValueError(
                f"`{name}` must be a floating-point tensor (float32, float64, ...), got "
                f"{value.dtype}; convert it with .float()"
            )


def check_response_dim(name: str, x: torch.Tensor, dim: int = -1) -> None:
    """Raise if the response dimension `dim` of `x` (the T of (B, T)) has length 0.

    An empty response has no token to put a reward, a log-prob or a loss on; without this the
    math would return empty tensors, nan means or a torch error far from the call. Only the
    shape is read (no device synchronisation); a 0-dim tensor has no response dimension.
    """
    if x.dim() > 0 and x.shape[dim] == 0:
        raise ValueError(
            f"`{name}` has an empty response dimension (shape {tuple(x.shape)}); there must be "
            "at least one token"
        )


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise unless every tensor given by keyword has the shape of the first one."""
    items = list(tensors.items())
    for name, value in items:
        check_tensor(name, value)
    first_name, first = items[0]
    for name, value in items[1:]:
        if value.shape != first.shape:
            raise ValueError(
                f"`{name}` has shape {tuple(value.shape)} but `{first_name}` has shape "
                f"{tuple(first.shape)}; they must match"
            )


def check_mask(mask: torch.Tensor, like: torch.Tensor, like_name: str = "x") -> torch.Tensor:
    """Check that `mask` has the shape of `like` and holds only 0 and 1; return it as `like`'s dtype.

    The last dimension of `like` is the response dimension and must not be empty.

    A mask of 0.5 or 2 is almost always a bug upstream (a sum of masks, a probability passed by
    mistake), so it is refused rather than used as a weight.
    """
    check_tensor("mask", mask)
    if mask.shape != like.shape:
        raise ValueError(
            f"`mask` has shape {tuple(mask.shape)} but `{like_name}` has shape "
            f"{tuple(like.shape)}; they must match"
        )
    check_response_dim(like_name, like)
    if mask.dtype != torch.bool and value_checks_on() and not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)].flatten()[:3].tolist()
        raise ValueError(
            f"`mask` must contain only 0 and 1 (1 = real response token), found values like {bad}"
        )
    dtype = like.dtype if like.is_floating_point() else torch.float32
    return mask.to(dtype)


def check_nonempty_mask(mask: torch.Tensor, what: str, dim: int | None = None) -> None:
    """Raise if `mask` has no 1 at all (dim=None) or a slice along `dim` with no 1."""
    if not value_checks_on():
        return
    if dim is None:
        if not bool(mask.any()):
            raise ValueError(f"`mask` has no real tokens (all zeros); cannot take {what}")
        return
    counts = mask.sum(dim=dim)
    if not bool((counts > 0).all()):
        empty = torch.nonzero(counts == 0)[:5].tolist()  # one index list per empty slice
        where = "[" + ", ".join(str(i[0]) if len(i) == 1 else str(tuple(i)) for i in empty) + "]"
        raise ValueError(
            f"`mask` has no real tokens along dim={dim} at index(es) {where}; cannot take {what}"
        )


def check_range(
    name: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Check a scalar lies in [low, high] (or an open end where asked); return it as float."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a number, got {value!r}") from None
    ok = v == v  # NaN fails every comparison below, but say so clearly
    if low is not None:
        ok = ok and (v > low if low_open else v >= low)
    if high is not None:
        ok = ok and (v < high if high_open else v <= high)
    if not ok:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        raise ValueError(f"`{name}` must be in {left}{lo}, {hi}{right}, got {value!r}")
    return v


def check_choice(name: str, value: str, choices: Iterable[str]) -> str:
    """Raise unless `value` is one of `choices`; the message lists the valid ones."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(
            f"unknown {name} {value!r}; valid values are: {', '.join(repr(c) for c in choices)}"
        )
    return value


def check_eval_count(n: int | None, available: int) -> None:
    """Refuse to evaluate more prompts than a run has, or none (None asks for the configured count)."""
    if n is not None and not 1 <= n <= available:
        raise ValueError(f"evaluate(n={n}): this run has {available} evaluation prompts; ask for 1 to {available}, "
                         "or give more with PPOTrainer(..., eval_prompts=[...])")
