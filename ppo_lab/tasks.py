"""Offline tasks: prompts, a gold reward, and the text the tiny model is pretrained on.

Chapter 7 (The PPO trainer end to end) trains on `sentiment`; chapter 8 (Reward models) learns
a reward for it from preference pairs; chapter 10 (Beyond PPO) uses `arithmetic`, whose reward
is verifiable. Everything here is generated from a seed, so no dataset is ever downloaded.

- `sentiment`: short review-like sentences ("the food was really good but the service was
  slow ."). Prompts are neutral openings ("the movie was"); the gold reward is the VADER
  compound score of the response, in [-1, 1]. The pretraining text is balanced between
  positive, negative and mixed reviews, so the base model's continuations average near 0 and
  PPO has room to make them positive.
- `arithmetic`: "1 2 + 7 =" -> "1 9" (numbers are written digit by digit). The reward is 1 for
  the right sum and 0 otherwise. `arithmetic-small` is the same with single-digit numbers.

A task is any object with `name`, `train_prompts`, `eval_prompts`, `reward(prompts,
responses)` and `corpus(n, seed)`; `get_task(name)` returns a built-in one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

SUBJECTS = [
    "movie", "film", "book", "show", "restaurant", "food", "hotel", "room", "service",
    "staff", "plot", "acting", "music", "ending", "album", "game", "coffee", "pizza", "trip",
    "story",
]  # fmt: skip
POSITIVE = [
    "good", "great", "wonderful", "amazing", "excellent", "lovely", "fun", "beautiful",
    "brilliant", "enjoyable", "perfect", "fantastic", "nice", "delightful", "charming",
]  # fmt: skip
NEGATIVE = [
    "bad", "terrible", "awful", "boring", "horrible", "dull", "poor", "disappointing", "ugly",
    "stupid", "weak", "sad", "annoying", "painful", "dreadful",
]  # fmt: skip
NEUTRAL = ["long", "short", "simple", "quiet", "slow", "loud", "new", "old", "small", "big", "cold", "warm"]
ADVERBS = ["really", "very", "quite", "so", "pretty", "rather"]
NEUTRAL_VERBS = ["watched", "saw", "tried", "visited", "read", "finished"]
POSITIVE_VERBS = ["loved", "liked", "enjoyed"]
NEGATIVE_VERBS = ["hated", "disliked"]


def _adj(rng: random.Random, mood: str) -> str:
    words = {"pos": POSITIVE, "neg": NEGATIVE, "neu": NEUTRAL}[mood]
    adj = rng.choice(words)
    return f"{rng.choice(ADVERBS)} {adj}" if rng.random() < 0.3 else adj


def review(rng: random.Random) -> str:
    """One review-like sentence; its mood is positive, negative or mixed with equal odds."""
    mood = rng.choice(["pos", "neg", "mix"])
    a = mood if mood != "mix" else rng.choice(["pos", "neg", "neu"])
    b = {"pos": "neg", "neg": "pos", "neu": rng.choice(["pos", "neg"])}[a] if mood == "mix" else mood
    s1, s2 = rng.sample(SUBJECTS, 2)
    verb = {"pos": POSITIVE_VERBS, "neg": NEGATIVE_VERBS, "neu": NEUTRAL_VERBS}[a]
    templates = [
        lambda: f"the {s1} was {_adj(rng, a)} .",
        lambda: f"the {s1} was {_adj(rng, a)} and the {s2} was {_adj(rng, a)} .",
        lambda: f"the {s1} was {_adj(rng, a)} but the {s2} was {_adj(rng, b)} .",
        lambda: f"this {s1} is {_adj(rng, a)} .",
        lambda: f"overall the {s1} was {_adj(rng, a)} .",
        lambda: f"i {rng.choice(NEUTRAL_VERBS)} the {s1} , it was {_adj(rng, a)} .",
        lambda: f"i {rng.choice(verb)} this {s1} .",
        lambda: f"what a {_adj(rng, a)} {s1} !",
        lambda: f"the {s1} is not {_adj(rng, a)} .",
        lambda: f"we {rng.choice(NEUTRAL_VERBS)} the {s1} . the {s2} was {_adj(rng, b)} .",
    ]
    return rng.choice(templates)()


def review_prompts(subjects: list[str]) -> list[str]:
    """Neutral openings of reviews: nothing in them decides the sentiment."""
    out = []
    for s in subjects:
        out += [f"the {s} was", f"this {s} is", f"overall the {s} was", f"i watched the {s} ,", f"we tried the {s} ."]
    return out


def _digits(n: int) -> str:
    return " ".join(str(n))


def addition(rng: random.Random, high: int = 30) -> tuple[str, str]:
    """("1 2 + 7 =", "1 9"): a prompt and its answer, numbers written digit by digit."""
    a, b = rng.randrange(high), rng.randrange(high)
    return f"{_digits(a)} + {_digits(b)} =", _digits(a + b)


@dataclass
class SentimentTask:
    """Make review continuations positive; gold reward = VADER compound score of the response."""

    name: str = "sentiment"
    train_prompts: list[str] = field(default_factory=lambda: review_prompts(SUBJECTS[:16]))
    eval_prompts: list[str] = field(default_factory=lambda: review_prompts(SUBJECTS[16:]))

    def __post_init__(self):
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self._vader = SentimentIntensityAnalyzer()

    def reward(self, prompts: list[str], responses: list[str]) -> list[float]:
        return [self._vader.polarity_scores(r)["compound"] for r in responses]

    def corpus(self, n: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        return [review(rng) for _ in range(n)]


@dataclass
class ArithmeticTask:
    """Two-number addition with a verifiable reward: 1 for the exact sum, else 0."""

    name: str = "arithmetic"
    high: int = 30
    n_train: int = 400
    n_eval: int = 100

    def __post_init__(self):
        rng = random.Random(12345)
        pairs = sorted({(rng.randrange(self.high), rng.randrange(self.high)) for _ in range(4000)})
        rng.shuffle(pairs)
        prompts = [f"{_digits(a)} + {_digits(b)} =" for a, b in pairs]
        self.train_prompts = prompts[: self.n_train]
        self.eval_prompts = prompts[self.n_train : self.n_train + self.n_eval]

    @staticmethod
    def answer(prompt: str) -> str:
        left = prompt.rstrip("= ").split("+")
        return _digits(sum(int(part.replace(" ", "")) for part in left))

    def reward(self, prompts: list[str], responses: list[str]) -> list[float]:
        return [float(r.strip() == self.answer(p)) for p, r in zip(prompts, responses)]

    def corpus(self, n: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            prompt, answer = addition(rng, self.high)
            out.append(f"{prompt} {answer}")
        return out


def small_arithmetic() -> ArithmeticTask:
    """Single-digit additions ("3 + 4 =" -> "7"): all 100 pairs, 80 for training and 20 held
    out. The tiny model gets about 15% right, and RL improves that within a minute on a CPU
    (chapter 10), where the two-digit task needs far longer."""
    return ArithmeticTask(name="arithmetic-small", high=10, n_train=80, n_eval=20)


TASKS = {"sentiment": SentimentTask, "arithmetic": ArithmeticTask, "arithmetic-small": small_arithmetic}


def get_task(name: str):
    """A fresh built-in task by name; a ValueError lists the valid names otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid values are: {', '.join(map(repr, TASKS))}")
    return TASKS[name]()


def vocabulary() -> list[str]:
    """Every word the built-in tasks can produce, sorted (the tiny tokenizer's vocabulary)."""
    words = set(SUBJECTS + POSITIVE + NEGATIVE + NEUTRAL + ADVERBS + NEUTRAL_VERBS + POSITIVE_VERBS + NEGATIVE_VERBS)
    words |= {
        "the", "was", "and", "but", "this", "is", "overall", "i", "it", "what", "a", "not", "we",
        ".", ",", "!", "+", "=",
    }  # fmt: skip
    words |= {str(d) for d in range(10)}
    return sorted(words)
