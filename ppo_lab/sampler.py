"""The sampler beside the trainer: which model draws the responses, in which precision, where
pi_old comes from, and the weights and metrics of the gap between the two (chapter 9).

In the large frameworks an inference engine samples and a training engine learns; their
log-probs differ, so the rollout's pi_old is either the sampler's own log-probs (the bypass
form, no extra forward) or a forward of the trainer (the decoupled form, with the correction
weights of `rollout_correction`). On one machine the sampler is the policy itself, and two
experiment switches make it differ: `sampler.noise` samples from a perturbed copy of the
weights, `sampler.precision` from a bfloat16 forward of an fp32 trainer.

`Sampler` holds those choices, so the trainer always makes the same calls, whatever the
configuration: the rollout asks it where pi_old comes from (`from_sampling`, `value_head`), for
the model that samples (`model`, under `autocast`) and for the correction `weights`; the
iteration's log asks for the gap `metrics`.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from .build import draws
from .models import PolicyWithValueHead
from .rollout_correction import correction_weights, gap_metrics


def old_logprobs_source(old_logprobs_from: str, precision: str, sampler_differs: bool, correction: str) -> str:
    """Where the rollout's old log-probs come from, "sampling" or "forward" (`old_logprobs_from`
    with "auto" resolved). The sampling logits save a forward; in half precision the cached and the
    full forward disagree by ~1e-2 nats, so auto recomputes them there, and so it does when the
    sampler is not the trainer or a correction needs the trainer's own log-probs (the
    decoupled form)."""
    if old_logprobs_from != "auto":
        return old_logprobs_from
    same = precision == "fp32" and not sampler_differs and correction == "none"
    return "sampling" if same else "forward"


class Sampler:
    """The model that samples, and what the rollout keeps of its log-probs.

    Args:
        lm: the policy's bare causal LM (copied when `noise` > 0).
        seed: the run's seed (the noise of iteration i is drawn from (seed, i)).
        noise: each weight of the sampler's copy is the policy's times 1 + noise x N(0, 1).
        precision: "same" (the trainer's) or "bf16" (sampling under bfloat16 autocast).
        old_logprobs_from: "auto", "sampling" or "forward" (see `old_logprobs_source`).
        trainer_precision: the trainer's precision (fp32, bf16, fp16).
        correction, level, low, high: `rollout_correction.correction_weights`'s kind, level and
            bounds ("none": no weights).
    """

    def __init__(self, lm, *, seed: int, noise: float = 0.0, precision: str = "same", old_logprobs_from: str = "auto",
                 trainer_precision: str = "fp32", correction: str = "none", level: str = "token", low: float = 0.0, high: float = 2.0):
        self.seed, self.noise, self.precision = seed, noise, precision
        self.correction, self.level, self.low, self.high = correction, level, low, high
        self.differs = noise > 0 or precision != "same"
        self.old_logprobs_from = old_logprobs_source(old_logprobs_from, trainer_precision, self.differs, correction)
        # the sampler's own copy of the weights, perturbed at every rollout (a stand-in for an inference engine)
        self.copy = copy.deepcopy(lm).requires_grad_(False) if noise > 0 else None

    @classmethod
    def from_config(cls, config, lm) -> Sampler:
        """The sampler of a `PPOConfig`'s fields."""
        return cls(
            lm, seed=config.run.seed, noise=config.sampler.noise, precision=config.sampler.precision, old_logprobs_from=config.sampler.old_logprobs_from,
            trainer_precision=config.memory.precision, correction=config.sampler.correction, level=config.sampler.correction_level,
            low=config.sampler.correction_low, high=config.sampler.correction_high,
        )

    @property
    def from_sampling(self) -> bool:
        """Whether pi_old is the sampling loop's own log-probs (no scoring forward of the policy)."""
        return self.old_logprobs_from == "sampling"

    def value_head(self, policy):
        """The value head of `policy` (a bare policy; a shared critic's), when the values can be read
        off the sampling loop's hidden states with pi_old; else None: the values then come from
        a forward (a sampler that differs from the trainer has no value head of its own)."""
        return policy.v_head if self.from_sampling and not self.differs and isinstance(policy, PolicyWithValueHead) else None

    def model(self, lm, iteration: int):
        """The model that samples at `iteration`: `lm` itself, or (noise > 0) its copy with every
        weight multiplied by 1 + noise x N(0, 1), drawn for this iteration."""
        if self.copy is None:
            return lm
        noise = draws(self.seed, iteration, "sampler")
        with torch.no_grad():
            for copied, weight in zip(self.copy.parameters(), lm.parameters()):
                scale = 1 + self.noise * torch.randn(weight.shape, generator=noise)
                copied.copy_(weight * scale.to(weight.device, weight.dtype))
        return self.copy

    def autocast(self, device_type: str):
        """bfloat16 autocast around sampling when the sampler's precision is bf16, else nothing."""
        if self.precision == "bf16":
            return torch.autocast(device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def weights(self, old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
        """(B, T) correction weights pi_old / pi_s, truncated or masked; None without a correction
        (a config with one never takes pi_old from sampling: `PPOConfig` refuses it)."""
        if self.correction == "none":
            return None
        return correction_weights(old_logprobs, sampler_logprobs, mask, kind=self.correction, level=self.level, low=self.low, high=self.high)

    def metrics(self, old_logprobs, sampler_logprobs, mask, weights) -> dict[str, torch.Tensor]:
        """The sampler/* metrics of the gap when the trainer computed pi_old with its own forward
        (`rollout_correction.gap_metrics`); none when pi_old is the sampler's."""
        if self.from_sampling:
            return {}
        return gap_metrics(old_logprobs, sampler_logprobs, mask, weights if weights is not None else mask.float(), kind=self.correction, level=self.level)
