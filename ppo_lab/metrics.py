"""What an iteration reports about its rollout, and the checks that stop a broken run.

Chapter 7 (The PPO trainer end to end) reads these metrics on the dashboard and the health panel.

Mostly pure functions of tensors: `rollout_metrics` gives the fixed metric names of the book's metrics table
(reward/..., objective/..., response/..., advantages/mean) as 0-dim tensors, so that the trainer
reads them back to the host in one transfer; `rollout_problems` and `weights_problem` say what
is not finite or has exploded; `RunHealth` keeps the count of skipped updates across iterations
and decides when a run stops.

The objective metrics follow the rewards the advantages were computed from (chapter 5):

    objective/non_score_reward = mean_b  -kl_coef * sum_t KL_est[b, t]      (kl_estimator)
    objective/rlhf_reward      = mean_b  (score'_b - kl_coef * sum_t KL_est[b, t])

with score' the score the rewards were shaped from (after the `reward.reference_norm` gain and
bias, `reward.truncated_score` or `reward.truncated_penalty`, `reward.normalize` and `reward.clip`); with
`kl.placement: reward` the second is exactly the mean summed shaped reward (before `advantage.whiten_rewards`).
`objective/kl` is always the k1 estimate sum_t (log pi_old - log pi_ref), the plain log-ratio
whose mean over samples is the sequence KL, whatever estimator shapes the reward.
"""

from __future__ import annotations

import math

import torch

from ._checks import NonFiniteError
from .kl import kl_penalty
from .masked import masked_mean

# An update that multiplies the trained weights' norm by more than this has exploded: ordinary
# updates change it by well under 1% (a learning rate of 5e4 multiplies it by about 10^5).
WEIGHT_GROWTH_LIMIT = 10.0


def rollout_metrics(
    *,
    scores: torch.Tensor,
    ended: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor | None,
    advantages: torch.Tensor | None,
    kl_coef: float,
    kl_in: str,
    kl_estimator: str,
) -> dict[str, torch.Tensor]:
    """The rollout's metrics as 0-dim tensors.

    Args:
        scores: (B,) raw scores from the reward; ended: (B,) bool.
        old_logprobs, ref_logprobs, entropy, mask: (B, T) from the rollout.
        rewards: (B, T) the shaped per-token rewards the advantages came from (None when the
            update was skipped); advantages: (B, T), or None likewise.
        kl_coef: the KL coefficient the rewards were shaped with (this iteration's).
        kl_in, kl_estimator: `kl.placement` and `kl.estimator` of `PPOConfig`.
    """
    kl_seq = (kl_penalty(old_logprobs, ref_logprobs, "k1") * mask).sum(1)  # (B,)
    estimate = kl_seq if kl_estimator == "k1" else (kl_penalty(old_logprobs, ref_logprobs, kl_estimator) * mask).sum(1)
    penalty_seq = -kl_coef * estimate  # (B,)
    if rewards is None:
        rlhf = torch.full((), math.nan, device=scores.device)
    elif kl_in == "reward":
        rlhf = rewards.sum(1).mean()  # score' - kl_coef * KL, exactly what GAE saw
    else:
        rlhf = (rewards.sum(1) + penalty_seq).mean()  # rewards hold score' only
    nan = torch.full((), math.nan, device=scores.device)
    return {
        "reward/score_mean": scores.mean(),
        "reward/score_std": scores.std() if len(scores) > 1 else torch.zeros((), device=scores.device),
        "reward/ended_frac": ended.float().mean(),
        "objective/kl": kl_seq.mean(),
        "objective/entropy": masked_mean(entropy, mask),
        "objective/non_score_reward": penalty_seq.mean(),
        "objective/rlhf_reward": rlhf,
        "response/length_mean": mask.sum(1).float().mean(),
        "advantages/mean": masked_mean(advantages, mask) if advantages is not None else nan,
    }


SCORE_LIMIT = 1e18  # float32's largest square root is 1.8e19


def rollout_problems(rollout, whiten: bool, reward_name: str) -> list[tuple[str, str, str]]:
    """(problem, metric, detail) for every non-finite or unusable quantity of a rollout (problem:
    "non-finite reward", "unusable reward" or "non-finite rollout"); ValueError for a bad mask.

    One read-back for the whole batch: is the mask 0/1 with a real token in every row, and is
    each quantity finite on real tokens? The advantages and the update then run without
    per-call value checks (`skip_value_checks`).
    """
    real = rollout.mask.bool()
    named = {"rollout/logprobs": rollout.old_logprobs, "rollout/ref_logprobs": rollout.ref_logprobs, "rollout/values": rollout.values}
    named = {k: v for k, v in named.items() if v is not None}
    mask_ok = ((rollout.mask == 0) | (rollout.mask == 1)).all() & real.any(dim=1).all() & (real.sum() >= (2 if whiten else 1))
    # a finite score past SCORE_LIMIT is unusable too: squared (whitening, the value loss) it
    # overflows float32, and the run would only report "non-finite gradients" without naming the reward
    usable = torch.isfinite(rollout.scores) & (rollout.scores.abs() <= SCORE_LIMIT)
    finite = torch.stack([mask_ok, usable.all()] + [(torch.isfinite(v) | ~real).all() for v in named.values()]).tolist()
    if not finite.pop(0):
        raise ValueError(
            "the rollout's response mask must hold only 0 and 1, with at least one real token in every row "
            "(and two in all to whiten the advantages: with batch.rollout = 1, set advantage.whiten to false)"
        )
    found = []
    if not finite[0]:
        bad = ~usable
        rows = torch.nonzero(bad).flatten()[:5].tolist()
        finite_bad = torch.isfinite(rollout.scores[bad])
        huge = bool(finite_bad.any())
        why = f"; scores beyond +-{SCORE_LIMIT:.0e} overflow float32 once squared (whitening and the value loss square them): scale the reward down" if huge else ""
        kind = "unusable reward" if bool(finite_bad.all()) else "non-finite reward"
        found.append((kind, "reward/score_mean", f"reward {reward_name} returned {rollout.scores[bad][:5].tolist()} for responses {rows}{why}"))
    for name, ok in zip(named, finite[1:]):
        if not ok:
            found.append(("non-finite rollout", name, "non-finite on real response tokens"))
    return found


@torch.no_grad()
def weight_norm(parameters: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all `parameters` together, as a 0-dim tensor (no read-back). Sharded
    parameters (FSDP2's DTensors) count whole: the squares of every process's shards are summed
    in one all-reduce."""
    device = parameters[0].device if parameters else None
    square = lambda ps: torch.stack([torch.linalg.vector_norm(p.detach().float()) for p in ps]).square().sum() if ps else torch.zeros((), device=device)  # noqa: E731
    sharded = [p.to_local() for p in parameters if hasattr(p, "to_local")]
    squares = square([p for p in parameters if not hasattr(p, "to_local")])
    if sharded:
        import torch.distributed as dist

        part = square(sharded)
        dist.all_reduce(part)  # every process's shards; the unsharded parameters counted once
        squares = squares + part
    return squares.sqrt()


def weights_problem(before: float, after: float) -> str | None:
    """What is wrong with the weights after an update, judged from their norm before and after."""
    if not math.isfinite(after):
        return "the weights are nan or inf after the update"
    if before > 0 and after > WEIGHT_GROWTH_LIMIT * before:
        return f"the update multiplied the norm of the trained weights by {after / before:.3g} (from {before:.4g} to {after:.4g}): they exploded"
    return None


# A policy has collapsed when it has stopped sampling anything: the mean entropy of its sampled
# tokens near 0, or every response a lone stop token (the shortest way out of an episode, where a
# wrecked policy tends to land). The weight-norm guard above sees neither: the norm barely moves.
# The floor sits below every healthy run explored for the book (temperature 1): entropies under
# 0.005 nats per token came only from chapter 6's sixteen unclipped epochs per batch (0.0028 at
# the lowest), by then answering every prompt with a lone stop token, which the second signature
# names. A learning rate of 0.3 drives the entropy below 1e-4 within six iterations.
ENTROPY_FLOOR = 1e-3


def collapse_problem(stats: dict[str, float]) -> str | None:
    """What says that an iteration's rollout came from a collapsed policy, or None; `stats` are
    its `rollout_metrics`, read back to floats."""
    if stats["response/length_mean"] <= 1 and stats["reward/ended_frac"] == 1:
        return "every response is a lone stop token (response/length_mean = 1, reward/ended_frac = 1)"
    if stats["objective/entropy"] < ENTROPY_FLOOR:
        return (f"objective/entropy = {stats['objective/entropy']:.2g} nats per token, below {ENTROPY_FLOOR:g}: "
                "the policy samples nearly every token with probability 1")
    return None


class CollapseWatch:
    """Names a collapse of the policy when it begins (`observe`, after every iteration) and every
    time a collapsed policy is saved (`saving`), so that no checkpoint or final policy passes
    for a good one without a warning. Training goes on: the run is the user's to stop."""

    def __init__(self):
        self.since: tuple[int, str, object] | None = None  # (iteration, what, newest checkpoint before it)

    def observe(self, iteration: int, stats: dict[str, float], learning_rate: float, newest_checkpoint) -> str | None:
        """The warning for a collapse that begins at `iteration`, else None. `newest_checkpoint()`
        gives the run's newest checkpoint (or None); it is called only when a collapse begins."""
        what = collapse_problem(stats)
        if what is None:
            self.since = None
            return None
        if self.since is not None:
            return None  # warned at its onset; saves warn while it lasts
        self.since = (iteration, what, newest_checkpoint())
        return (
            f"iteration {iteration}: the policy has collapsed: {what} (objective/kl = {stats['objective/kl']:.3g} nats "
            f"from the reference). A learning rate far too large (optim.lr = {learning_rate:g}) or too many epochs on "
            f"one batch usually does this. Training goes on, but what is saved from here on is the collapsed policy; {self._before()}"
        )

    def saving(self, iteration: int, what: str) -> str | None:
        """The warning for saving `what` (a checkpoint or the final policy) at `iteration` while the
        policy is collapsed, else None."""
        if self.since is None:
            return None
        return f"{what} at iteration {iteration} holds a collapsed policy (since iteration {self.since[0]}: {self.since[1]}); {self._before()}"

    def _before(self) -> str:
        earlier = self.since[2]
        return f"the newest checkpoint from before the collapse is {str(earlier)!r}" if earlier else "no checkpoint was written before it"


def mean_metrics(collected: dict[str, list[torch.Tensor]], reduce=lambda t: t) -> dict[str, float]:
    """Each metric's mean over the optimizer steps it was collected at (then `reduce`d, e.g. over
    processes), read back to the host in one transfer."""
    keys = sorted(collected)
    if not keys:
        return {}
    means = torch.stack([torch.stack([v.float() for v in collected[k]]).mean() for k in keys])
    return dict(zip(keys, reduce(means).tolist()))


def health_message(iteration: int, broken: str | None, skipped: list, bad_updates: int, newest, *, max_bad_updates: int, learning_rate: float) -> tuple[str | None, bool]:
    """(message, fatal) after an iteration: exploded or non-finite weights stop the run; a
    skipped update warns, and stops the run at `max_bad_updates` skipped updates.
    `newest` is the newest checkpoint (or None), named so the user knows where to resume."""
    if broken:
        where = f"; the newest checkpoint is {str(newest)!r}" if newest else ""
        return f"iteration {iteration}: {broken} (optim.lr = {learning_rate:g} is probably far too large). Stopping; the final policy is not saved{where}", True
    if not skipped:
        return None, False
    problem, metric, detail = skipped[0]
    message = f"iteration {iteration}: update skipped ({bad_updates} of at most {max_bad_updates}): {problem} ({metric}: {detail})"
    if bad_updates < max_bad_updates:
        return message, False
    where = f"; the newest checkpoint is {str(newest)!r} (written when its iteration's weights and metrics were finite)" if newest else ""
    return f"{message}. Stopping: run.max_bad_updates = {max_bad_updates} reached{where}", True


class RunHealth:
    """A run's health across its iterations: updates skipped for nan or inf, counted against
    `max_bad_updates`; weights that exploded; a collapse of the policy (`CollapseWatch`).

    `after` is called after every iteration: it raises `NonFiniteError` (carrying the iteration's
    metrics, which are still logged) to stop the run, and returns the warnings to give."""

    def __init__(self, max_bad_updates: int, learning_rate: float):
        self.max_bad_updates, self.learning_rate = max_bad_updates, learning_rate
        self.bad_updates = 0  # kept in checkpoints
        self.collapse = CollapseWatch()

    def after(self, iteration: int, skipped: list, norm_before: float, norm_after: float, stats: dict, metrics: dict, checkpoints) -> list[str]:
        """Judge the iteration that just ended: `skipped` lists why its update (or steps) were
        skipped, the norms are the trained weights' before and after it, `stats` its rollout
        metrics (floats), and `checkpoints()` the run's checkpoints, newest first."""
        broken = weights_problem(norm_before, norm_after)
        newest = checkpoints() if broken or skipped else []
        self.bad_updates += bool(skipped)
        message, fatal = health_message(
            iteration, broken, skipped, self.bad_updates, newest[0] if newest else None, max_bad_updates=self.max_bad_updates, learning_rate=self.learning_rate
        )
        if fatal:
            raise NonFiniteError(message, metrics=metrics)
        collapsed = self.collapse.observe(iteration, stats, self.learning_rate, lambda: next(iter(checkpoints()), None))
        return [note for note in (message, collapsed) if note]


def eval_metrics(samples: list[dict]) -> dict[str, float]:
    """The eval/* metrics of an evaluation's samples: the mean score, and the mean gold score
    when the samples carry one (a run with a gold reward)."""
    metrics = {"eval/score_mean": sum(s["score"] for s in samples) / len(samples)}
    if samples and "gold" in samples[0]:
        metrics["eval/gold_mean"] = sum(s["gold"] for s in samples) / len(samples)
    return metrics
