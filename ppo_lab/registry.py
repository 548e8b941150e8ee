"""Functions by name: the registries of advantage estimators and policy losses.

Chapter 4 (the estimators), chapter 6 (the policy losses) and chapter 10 add algorithms as
functions, not as edits of the trainer: a function is registered under a name with a decorator,
and the config names it (`advantage.estimator: grpo`, `loss.policy: cispo`). A `Registry` is a
dict of name -> function with the two things both registries need: a decorator that refuses a
name twice, and a lookup whose error lists the valid names.
"""

from __future__ import annotations

from typing import Callable


class Registry(dict):
    """name -> function, for one kind of function ("advantage estimator", "policy loss").

    `wrap(name, fn)`, if given, is what the registry stores for `fn` (the estimators store a
    checked version); the decorator still returns `fn` itself."""

    def __init__(self, kind: str, wrap: Callable | None = None):
        super().__init__()
        self.kind, self.wrap = kind, wrap

    def register(self, name: str) -> Callable[[Callable], Callable]:
        """Decorator: make a function available under `name` (names must be new)."""

        def add(fn: Callable) -> Callable:
            if name in self:
                article = "an" if self.kind[0] in "aeiou" else "a"
                raise ValueError(f"{article} {self.kind} named {name!r} is already registered")
            self[name] = self.wrap(name, fn) if self.wrap is not None else fn
            return fn

        return add

    def lookup(self, name: str) -> Callable:
        """The function registered as `name`; a ValueError lists the valid names otherwise."""
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; valid values are: {', '.join(map(repr, sorted(self)))}")
        return self[name]
