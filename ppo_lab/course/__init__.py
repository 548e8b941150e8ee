"""Course assignments built from `ppo_lab` itself, and their offline autograder.

Each assignment is a set of solution regions in the package's source (`regions`), a handout, and
checks under `checks/`: public ones that the student gets, hidden ones that only the grader runs.
`create` writes a student's starting folder (the package with the assignment's regions cut out,
the handout as README.md, the public checks); `grade` runs every check against such a folder
and scores it, one score per property, summed per function (`grader`). The reference solution is
the package as installed, so it is always the tested code.

    ppo-lab-course list
    ppo-lab-course create gae ./gae-student          (--solution: the reference instead)
    ppo-lab-course grade ./gae-student --json report.json

Appendix D of the book (For instructors) explains the assignments and the workflow.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ASSIGNMENTS", "Assignment", "assignment", "create", "grade"]


@dataclass(frozen=True)
class Assignment:
    """One assignment: its name, the functions its regions sit in (module, function), the
    chapters to read first, what it teaches and an estimate of the time a student needs."""

    name: str
    title: str
    functions: tuple[tuple[str, str], ...]
    chapters: str
    teaches: str
    hours: str

    @property
    def reading(self) -> str:
        """What to read first, as "chapter 1" or "chapters 2, 4"."""
        return ("chapters " if any(c in self.chapters for c in ",-") else "chapter ") + self.chapters


#: The course's assignments by name, in the order of the chapters.
ASSIGNMENTS: dict[str, Assignment] = {
    a.name: a
    for a in (
        Assignment(
            "logprobs", "Log-probabilities and response masks",
            (("ppo_lab.logprobs", "logprobs_from_logits"), ("ppo_lab.masked", "response_mask")),
            "1", "the policy as next-token log-probabilities at the sampling temperature; which "
            "tokens of a padded batch are real (up to and including the first EOS, whatever the padding holds)",
            "1-2",
        ),
        Assignment(
            "gae", "Generalized advantage estimation and whitening",
            (("ppo_lab.gae", "compute_gae"), ("ppo_lab.masked", "masked_whiten")),
            "2, 4", "the backward GAE recursion and its lambda-returns over the real tokens only; "
            "whitening advantages with statistics of the real tokens", "2",
        ),
        Assignment(
            "shaping", "Reward shaping with the KL penalty",
            (("ppo_lab.shaping", "last_real_index"), ("ppo_lab.shaping", "shape_rewards")),
            "5", "turning one score per response into per-token rewards: the KL penalty on every "
            "real token, the score on the last one (where it lands when pad == eos)", "1-2",
        ),
        Assignment(
            "clipping", "The clipped policy loss and the clipped value loss",
            (("ppo_lab.clipping", "clipped_policy_loss"), ("ppo_lab.value", "clipped_value_loss")),
            "6", "PPO-clip's pessimistic bound and where its gradient is cut; value clipping "
            "around the old prediction", "2",
        ),
        Assignment(
            "ppo_update", "One PPO update",
            (("ppo_lab.update", "ppo_update"),),
            "4-7", "composing the pieces into one update: shaped rewards, GAE, whitening, then "
            "epochs of shuffled minibatches each taking one optimizer step on the clipped losses",
            "2-3",
        ),
        Assignment(
            "grpo", "Critic-free advantages: RLOO and GRPO",
            (("ppo_lab.estimators", "rloo_estimator"), ("ppo_lab.estimators", "grpo_estimator")),
            "10", "group baselines without a critic: the leave-one-out mean, the group mean "
            "divided by the group's standard deviation, broadcast over each response's tokens", "1-2",
        ),
    )
}


def assignment(name: str) -> Assignment:
    """The assignment called `name`; a ValueError lists the names when there is none."""
    if name not in ASSIGNMENTS:
        raise ValueError(f"no assignment {name!r}; the assignments are: {', '.join(ASSIGNMENTS)}")
    return ASSIGNMENTS[name]


def create(name: str, folder, *, solution: bool = False):
    """Write the starting folder of assignment `name` (see `handout.create`)."""
    from .handout import create as _create

    return _create(assignment(name), folder, solution=solution)


def grade(folder, **kwargs):
    """Grade a folder made by `create` (see `grader.grade`)."""
    from .grader import grade as _grade

    return _grade(folder, **kwargs)
