"""The package's layout rules, checked on its source (book/guide_library.md describes them).

The math modules are pure functions that never see a config; the trainer is the loop and
nothing else, so it stays short and no other module reaches into it; every module is listed in
the package's table. These hold by design, and these tests keep them from eroding one switch
at a time (the trainer once grew from 378 lines to 606 in three chapters).
"""

import ast
import pathlib
import re

import pytest

import ppo_lab
from ppo_lab.registry import Registry

PACKAGE = pathlib.Path(ppo_lab.__file__).parent
MODULES = sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
# The modules where a config may enter: building a run from it, the one place where it meets
# the math (objective), the sampler's settings, the trainer, the config itself and its command
# line, a run's folder (it writes config.yaml), the memory estimate of a configuration, and
# transformers' own model configs (models).
CONFIG_BOUNDARY = {"build", "cli", "config", "memory", "models", "objective", "run_output", "sampler", "trainer"}
TRAINER_LIMIT = 400  # lines, module docstring included
MODULE_LIMIT = 400


def _functions(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_outside_the_config_boundary_takes_a_config():
    offenders = []
    for path in MODULES:
        if path.stem in CONFIG_BOUNDARY:
            continue
        for fn in _functions(path):
            params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
            if params & {"config", "cfg"}:
                offenders.append(f"{path.name}:{fn.lineno} {fn.name}")
    assert offenders == []


def test_no_module_but_the_trainer_touches_a_private_trainer_attribute():
    pattern = re.compile(r"\btrainer\._[a-z]")
    offenders = [f"{p.name}:{i}" for p in MODULES if p.stem != "trainer" for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_the_trainer_and_every_module_stay_short():
    lengths = {p.stem: len(p.read_text().splitlines()) for p in MODULES}
    assert lengths["trainer"] <= TRAINER_LIMIT
    assert {m: n for m, n in lengths.items() if n >= MODULE_LIMIT} == {}


def test_the_package_table_lists_every_module():
    listed = set(re.findall(r"`([a-z_]+)`", ppo_lab.__doc__.split("The math")[0]))
    public = {p.stem for p in MODULES if not p.stem.startswith("_")} | {"course"}
    assert public - listed == set()
    # and each is reachable as ppo_lab.<name>: the math imported with the package, the rest on first use
    eager = set(re.findall(r"^from \.([a-z_]+) import", (PACKAGE / "__init__.py").read_text(), re.M))
    assert public - {"course"} - eager - ppo_lab._LAZY_MODULES == set()


def test_a_registry_refuses_a_name_twice_and_lists_the_valid_names():
    reg = Registry("advantage estimator")

    @reg.register("mine")
    def mine(rewards, mask, **_):
        return rewards, rewards

    assert reg.lookup("mine") is mine and "mine" in reg
    with pytest.raises(ValueError, match=r"an advantage estimator named 'mine' is already registered"):
        reg.register("mine")(mine)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope'; valid values are: 'mine'"):
        reg.lookup("nope")
    checked = Registry("policy loss", wrap=lambda name, fn: (name, fn))
    checked.register("x")(mine)
    assert checked["x"] == ("x", mine)  # the registry stores the wrapped function, the decorator returns the function
