"""Count the places where the host waits for the device (host-device synchronisations).

Chapter 9 (Scaling up) uses this module. On a GPU, Python runs ahead of the device and queues
kernels; any call that needs a tensor's *value* on the host (`.item()`, `bool(t)`, `.tolist()`,
`torch.nonzero`, indexing with a boolean mask) makes Python wait until the queue has drained.
A training loop that does it in every micro-batch leaves the GPU idle between kernels.

On a CPU nothing waits, but the same calls are made, so they can be counted anywhere: a
`torch.overrides.TorchFunctionMode` sees every torch call made from Python and `SyncCounter`
tallies the ones that read values back. It is not an exact count for a GPU run: a few of the
tensors it sees read live on the CPU there (the reward's scores), while copies between host and
device (`.to(device)`, `torch.tensor(..., device=...)`) and syncs inside single C++ ops are not
counted.

    with SyncCounter() as syncs:
        trainer.iterate()
    print(syncs.total, syncs.by_op.most_common(5))
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods and functions whose result is a host value computed from device memory.
SYNC_OPS = frozenset(
    {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__format__", "nonzero", "masked_select", "numpy", "unique", "argwhere"}
)


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


class SyncCounter(TorchFunctionMode):
    """Count the calls that would synchronise a GPU; `by_op` (a Counter) and `total`.

    `phase` (settable while counting) labels each count; `by_phase` tallies them per label.
    `by_origin` tallies them by the top-level package of the code that made the call
    (`ppo_lab`, `transformers`, ...), so a library's own read-backs can be told apart.
    """

    def __init__(self):
        super().__init__()
        self.by_op: Counter = Counter()
        self.by_phase: Counter = Counter()
        self.by_origin: Counter = Counter()
        self.phase = "all"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = _name(func)
        if name in SYNC_OPS or (name == "__getitem__" and len(args) > 1 and _is_bool_index(args[1])):
            self.by_op[name] += 1
            self.by_phase[self.phase] += 1
            self.by_origin[_origin()] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


def _origin() -> str:
    """The top-level package of the innermost caller outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        package = str(frame.f_globals.get("__name__", "?")).split(".")[0]
        if package != "torch" and frame.f_globals.get("__name__") != __name__:
            return package
        frame = frame.f_back
    return "?"


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
