"""KL coefficient controllers: how strongly the policy is held near the reference.

Chapter 5 (Reward shaping and the KL penalty) shows them holding a target; chapter 6 (Clipping)
compares the PPO-penalty rule with PPO-clip. Each controller keeps the current coefficient in
`.value` and changes it in `.update(current_kl, n_steps)` after each PPO iteration; the trainer
reads `.value` for the next rollout's reward shaping (or KL loss). All three save and restore
their state with `state_dict()` / `load_state_dict()`, so a resumed run continues the schedule.
"""

from __future__ import annotations

from ._checks import check_range


class FixedKLController:
    """A constant coefficient: `update` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = check_range("kl_coef", kl_coef, low=0.0)

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """The proportional controller of Ziegler et al. (2019), "Fine-Tuning Language Models from
    Human Preferences", section 2.2, as used by TRL and verl:

        e = clip(KL / target - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    The clip keeps one noisy KL estimate from moving beta by more than 0.2 * n_steps / horizon.
    `n_steps` is the number of samples (or updates) since the last call, so `horizon` is in the
    same unit: how many of them it takes to correct a 20% error by about e^0.2.
    """

    def __init__(self, kl_coef: float, target: float, horizon: float):
        self.value = check_range("kl_coef", kl_coef, low=0.0)
        self.target = check_range("target", target, low=0.0, low_open=True)
        self.horizon = check_range("horizon", horizon, low=0.0, low_open=True)

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        current_kl = check_range("current_kl", current_kl)
        n_steps = check_range("n_steps", n_steps, low=0.0)
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])


class PPOPenaltyKLController:
    """The adaptive KL penalty of the PPO paper (Schulman et al., 2017, section 4):

        if KL > 1.5 * target:  beta <- 2 * beta
        if KL < target / 1.5:  beta <- beta / 2

    and unchanged in between. The paper notes the constants 1.5 and 2 are heuristic and the
    algorithm is not very sensitive to them; `n_steps` is accepted for a common interface and
    ignored (the rule fires once per call).
    """

    def __init__(self, kl_coef: float, target: float):
        self.value = check_range("kl_coef", kl_coef, low=0.0)
        self.target = check_range("target", target, low=0.0, low_open=True)

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        current_kl = check_range("current_kl", current_kl)
        if current_kl > 1.5 * self.target:
            self.value *= 2.0
        elif current_kl < self.target / 1.5:
            self.value /= 2.0
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
