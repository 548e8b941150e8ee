"""The parts every config group is made of: a field with its help, range and resume policy, and
the group that coerces and checks its fields when it is constructed.

Chapter 7 (The PPO trainer end to end) reads `PPOConfig`, which is built from these groups
(`config.py`); `sampling.Sampling` is one of them. A field states once what it accepts (`_f`);
the command line, the YAML reader and every error message are generated from that statement, so
a bad value fails before any model is loaded, with a message that names the field by its dotted
name (`optim.lr = -1.0 must be ...`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from dataclasses import field


def _f(default, help: str, choices=None, *, low=None, high=None, low_open=False, high_open=False, resume="fixed"):
    """A field with its help text, and the one statement of what it accepts.

    `low` / `high` bound a number (open or closed ends; an int field is checked as an integer
    >= low); an optional field (type `X | None`) accepts None too. `resume`: "free" when the
    field may change between a run and its resumption without changing what the run computes
    (logging, checkpointing, the length of the run); "fixed" fields are compared on resume.
    """
    meta = {"help": help, "resume": resume}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if low is not None:
        meta["range"] = (low, high, low_open, high_open)
    return field(default=default, metadata=meta)


def internal(default, why: str):
    """A field the code fills in (not a setting): not in YAML, flags, `to_dict` or resume checks."""
    return field(default=default, metadata={"help": why, "internal": True})


def settings(cls) -> list[dataclasses.Field]:
    """The fields of a group that are settings (every field but the internal ones)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def group(key: str):
    """Make `cls` a config group named `key` (its place in `PPOConfig` and its flags' prefix):
    a keyword-only dataclass that converts YAML and command-line strings to each field's type,
    checks each value against its field, then the relations inside the group (`cls.check`).
    An unknown keyword gets a TypeError that names the near miss."""

    def make(cls):
        cls = dataclasses.dataclass(kw_only=True)(cls)
        cls.key = key
        init = cls.__init__

        @functools.wraps(init)
        def checked(self, *args, **kwargs):
            unknown = unknown_names(cls, kwargs, with_internal=True)
            if unknown:
                raise TypeError(unknown)
            init(self, *args, **kwargs)

        cls.__init__ = checked
        return cls

    return make


class Group:
    """Base of the config groups. Subclasses state their relations in `check()`."""

    key: typing.ClassVar[str] = ""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in settings(self):
            setattr(self, f.name, _convert(f"{self.key}.{f.name}", getattr(self, f.name), hints[f.name]))
        self.validate()

    def validate(self) -> None:
        """Check every value against its field, then the relations inside the group."""
        hints = typing.get_type_hints(type(self))
        for f in settings(self):
            name, value = f"{self.key}.{f.name}", getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                raise ValueError(f"{name} = {value!r} is not allowed; valid values are: {', '.join(map(repr, choices))}")
            if "range" in f.metadata and value is not None:
                optional = type(None) in typing.get_args(hints[f.name])
                _check_range(name, value, *f.metadata["range"], integer=_base_type(hints[f.name]) is int, optional=optional)
        self.check()

    def check(self) -> None:
        """The relations between this group's fields (none by default)."""

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in settings(self)}


def unknown_names(cls, data: dict, moved: dict[str, str] | None = None, with_internal: bool = False) -> str | None:
    """"unknown optim field(s): 'lrr' (did you mean 'lr'?)" for the keys of `data` that are not
    settings of `cls` (or internal fields, `with_internal`), or None. `moved` maps old names to
    their dotted new place."""
    names = [f.name for f in (dataclasses.fields(cls) if with_internal else settings(cls))]
    unknown = sorted(set(data) - set(names))
    if not unknown:
        return None

    def hint(u):
        if moved and u in moved:
            return f"{u!r} (now {moved[u]!r})"
        near = next(iter(difflib.get_close_matches(u, names, 1)), None)
        return f"{u!r} (did you mean {near!r}?)" if near else repr(u)

    return f"unknown {cls.key} field(s): {', '.join(hint(u) for u in unknown)}"


def _base_type(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _convert(name: str, value, hint):
    """YAML and the command line give strings and ints; check and convert them to `hint`."""
    optional = type(None) in typing.get_args(hint) or (isinstance(hint, types.UnionType) and type(None) in hint.__args__)
    kind = _base_type(hint)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise ValueError(f"{name} must not be None (expected {kind.__name__})")
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
                return value.lower() in ("true", "yes", "1", "on")
            raise ValueError
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        raise ValueError(f"{name} = {value!r} is not a valid {kind.__name__}") from None
    return value


def _check_range(name, v, low, high, low_open, high_open, integer=False, optional=False):
    if integer:
        if v < low or (high is not None and v > high):
            bound = f">= {low}" if high is None else f"from {low} to {high}"
            raise ValueError(f"{name} = {v!r} must be an integer {bound}" + (" (or None)" if optional else ""))
        return
    ok = math.isfinite(v) and (v > low if low_open else v >= low) and (high is None or (v < high if high_open else v <= high))
    if not ok:
        lo = "(" if low_open else "["
        hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
        off = " (None switches it off)" if optional else ""
        raise ValueError(f"{name} = {v!r} must be a finite number in {lo}{low:g}, {hi}{off}")
