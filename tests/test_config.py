import argparse

import pytest
import yaml

from ppo_lab.config import PPOConfig


def test_defaults_are_valid_and_documented():
    import dataclasses

    from ppo_lab.config import GROUPS
    from ppo_lab.fields import settings

    cfg = PPOConfig()
    for key, group in GROUPS.items():
        assert isinstance(getattr(cfg, key), group)
        for f in settings(group):
            assert f.metadata.get("help"), f"{key}.{f.name} has no help text"
        assert 1 <= len(settings(group)) <= 15, key  # a group small enough to read at once
    assert [f.name for f in dataclasses.fields(cfg)] == list(GROUPS)
    assert cfg.policy.model == "builtin:tiny" and len(cfg.flat()) == 101


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"advantage.gamma": 1.5}, r"advantage.gamma = 1.5 must be a finite number in \[0, 1\]"),
        ({"advantage.lam": -0.1}, r"advantage.lam = -0.1 must be a finite number in \[0, 1\]"),
        ({"optim.lr": 0}, r"optim.lr = 0.0 must be a finite number in \(0, inf\)"),
        ({"sampling.temperature": 0}, r"sampling.temperature"),
        ({"batch.epochs": 0}, r"batch.epochs = 0 must be an integer >= 1"),
        ({"critic.design": "tied"}, r"critic.design = 'tied' is not allowed; valid values are: 'separate', 'shared', 'none'"),
        ({"kl.estimator": "k5"}, r"kl.estimator = 'k5' is not allowed; valid values are: 'k1', 'k2', 'k3', 'abs'"),
        ({"advantage.estimator": "vtrace"}, r"advantage.estimator = 'vtrace' is not allowed; valid values are: .*'gae'.*'grpo'"),
        ({"loss.aggregation": "sum"}, r"loss.aggregation = 'sum' is not allowed"),
        ({"loss.dual_clip": 0.5}, r"loss.dual_clip = 0.5 must be a finite number in \(1, inf\)"),
        ({"batch.rollout": 64, "batch.minibatch": 24}, r"batch.rollout = 64 is not divisible by batch.minibatch = 24"),
        ({"batch.minibatch": 16, "batch.accumulation_steps": 3}, r"batch.minibatch = 16 is not divisible by batch.accumulation_steps = 3"),
        ({"batch.rollout": 64, "sampling.responses_per_prompt": 3, "batch.minibatch": 16}, r"batch.rollout = 64 is not divisible by sampling.responses_per_prompt = 3"),
        ({"advantage.estimator": "grpo"}, r"responses_per_prompt >= 2"),
        ({"critic.design": "none"}, r"critic.design = 'none' cannot be used with advantage.estimator = 'gae'"),
        ({"optim.lr": "fast"}, r"optim.lr = 'fast' is not a valid float"),
        ({"batch.epochs": 2.5}, r"batch.epochs = 2.5 is not a valid int"),
        ({"advantage.whiten": "maybe"}, r"advantage.whiten = 'maybe' is not a valid bool"),
        ({"data.task": "chess"}, r"data.task = 'chess' is not allowed"),
        # inf passed the range check ("(0, inf)") and trained every weight to nan
        ({"optim.lr": float("inf")}, r"optim.lr = inf must be a finite number in \(0, inf\)"),
        ({"optim.lr": "inf"}, r"optim.lr = inf must be a finite number"),
        ({"optim.max_grad_norm": float("inf")}, r"optim.max_grad_norm = inf must be a finite number"),
        ({"kl.coef": float("nan")}, r"kl.coef = nan must be a finite number"),
        ({"batch.forward": 0}, r"batch.forward = 0 must be an integer >= 1 \(or None\)"),
        # peft refuses it only after minutes of loading
        ({"lora.dropout": 1.0}, r"lora.dropout = 1.0 must be a finite number in \[0, 1\)"),
    ],
)
def test_invalid_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**kwargs)


def test_processes_must_divide_the_minibatch():
    cfg = PPOConfig(**{"batch.rollout": 48, "batch.minibatch": 12})
    cfg.check_divisibility(processes=4)
    with pytest.raises(ValueError, match=r"batch.minibatch = 12 is not divisible by batch.accumulation_steps x processes = 8"):
        cfg.check_divisibility(processes=8)
    accumulating = PPOConfig(**{"batch.rollout": 48, "batch.minibatch": 12, "batch.accumulation_steps": 3})
    accumulating.check_divisibility(processes=2)
    with pytest.raises(ValueError, match=r"batch.minibatch = 12 is not divisible by batch.accumulation_steps x processes = 9"):
        accumulating.check_divisibility(processes=3)
    with pytest.raises(ValueError, match=r"batch.rollout = 48 is not divisible by the number of processes = 5"):
        PPOConfig(**{"batch.rollout": 48, "batch.minibatch": 48, "batch.accumulation_steps": 1}).check_divisibility(processes=5)


def test_yaml_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"optim": {"lr": 1e-5}, "critic": {"design": "shared"}, "reward": {"clip": None}, "run": {"iterations": 7}}))
    cfg = PPOConfig.from_yaml(path, **{"run.iterations": "9"})
    assert cfg.optim.lr == 1e-5 and cfg.critic.design == "shared" and cfg.run.iterations == 9 and cfg.reward.clip is None
    cfg.to_yaml(tmp_path / "round.yaml")
    assert PPOConfig.from_yaml(tmp_path / "round.yaml") == cfg
    assert yaml.safe_load((tmp_path / "round.yaml").read_text())["optim"]["lr"] == 1e-5  # nested, one mapping per group
    # dotted keys are the same settings, and may sit beside the groups
    path.write_text("optim.lr: 1.0e-5\ncritic:\n  design: shared\nreward.clip: null\nrun.iterations: 9\n")
    assert PPOConfig.from_yaml(path) == cfg


def test_the_three_ways_to_write_a_config_are_one_config():
    from ppo_lab.config import Optim

    one = PPOConfig(optim={"lr": 1e-4}, run={"seed": 3})
    assert one == PPOConfig(optim=Optim(lr=1e-4), run={"seed": 3}) == PPOConfig(**{"optim.lr": 1e-4, "run.seed": 3})
    assert one == PPOConfig.from_dict(one.flat()) == PPOConfig.from_dict(one.to_dict())
    assert one.replace({"optim.lr": 2e-4}).optim.lr == 2e-4 and one.optim.lr == 1e-4  # a copy
    # the sampling group is ppo_lab.Sampling itself; its stop_ids are the build's, not a setting
    from ppo_lab import Sampling

    two = PPOConfig(sampling=Sampling(max_new_tokens=6, stop_ids=[2]))
    assert two == PPOConfig(**{"sampling.max_new_tokens": 6}) and two.sampling.stop_ids == ()
    assert "stop_ids" not in two.to_dict()["sampling"]


@pytest.mark.parametrize(
    "given, message",
    [
        ({"learning_rate": 1e-4}, r"^learning_rate is now optim.lr$"),
        ({"kl_target": 1.0, "total_iterations": 3}, r"^kl_target is now kl.target; total_iterations is now run.iterations$"),
        ({"kind": "k3"}, r"^kind is now kl.estimator$"),
        ({"optim": {"learning_rate": 1e-4}}, r"unknown optim field\(s\): 'learning_rate' \(now 'optim.lr'\)"),
        ({"optim.lrr": 1e-4}, r"unknown optim field\(s\): 'lrr' \(did you mean 'lr'\?\)"),
        ({"lr": 1e-4}, r"unknown PPOConfig setting 'lr' \(did you mean 'critic.lr' or 'optim.lr'\?\)"),
        ({"optim": 1e-4}, r"PPOConfig.optim is a group: give a dict of its fields or a Optim"),
        ({"loss.policy": "kl_penalty"}, r"loss.policy = 'kl_penalty' is now 'ppo_penalty'"),
    ],
)
def test_an_old_or_unknown_name_says_where_it_went(given, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        PPOConfig.from_dict(given)
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(given))
    with pytest.raises(ValueError, match=r"config file '.*old.yaml': " + message.lstrip("^")):
        PPOConfig.from_yaml(path)
    if all("." not in k for k in given) and not isinstance(next(iter(given.values())), (dict, float)) or "learning_rate" in given:
        with pytest.raises(TypeError, match=message):
            PPOConfig(**given)


def test_a_checkpoint_config_from_before_the_groups_is_read_in_its_groups():
    from ppo_lab.config import upgrade

    old = {"learning_rate": 1e-4, "critic": "shared", "total_iterations": 9, "gone_field": 1}
    assert upgrade(old) == {"optim": {"lr": 1e-4}, "critic": {"design": "shared"}, "run": {"iterations": 9}}
    now = PPOConfig().to_dict()
    assert upgrade(now) is now


def test_yaml_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        PPOConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        PPOConfig.from_yaml(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("optim:\n  lrr: 0.1\n")
    with pytest.raises(ValueError, match=r"typo.yaml': unknown optim field\(s\): 'lrr' \(did you mean 'lr'\?\)"):
        PPOConfig.from_yaml(typo)
    broken = tmp_path / "broken.yaml"
    broken.write_text("learning_rate: 1e-5\ncritic: [shared\nseed: 3\n")
    with pytest.raises(ValueError, match=r"config file '.*broken.yaml' is not valid YAML at line \d+, column \d+: "):
        PPOConfig.from_yaml(broken)
    with pytest.raises(ValueError, match=r"config file '.*' is a folder; give a YAML file"):
        PPOConfig.from_yaml(tmp_path)
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"config file '.*model.safetensors' is not a text file"):
        PPOConfig.from_yaml(binary)


def test_command_line_flags(tmp_path):
    parser = argparse.ArgumentParser()
    PPOConfig.add_arguments(parser)
    path = tmp_path / "c.yaml"
    path.write_text("kl:\n  coef: 0.3\nbatch:\n  epochs: 2\n")
    args = parser.parse_args(["--batch.epochs", "3", "--advantage.whiten", "false", "--reward.clip", "none", "--sampling.top-p", "0.9"])
    cfg = PPOConfig.from_args(str(path), args)
    assert (cfg.kl.coef, cfg.batch.epochs, cfg.advantage.whiten, cfg.reward.clip, cfg.sampling.top_p) == (0.3, 3, False, None, 0.9)
    with pytest.raises(SystemExit):
        parser.parse_args(["--critic.design", "tied"])
    # --help lists the flags by group, each flag once
    text = parser.format_help()
    assert "optim:\n" in text and "--optim.lr FLOAT" in text and "--run.seed SEED, --run.seed" not in text
    assert text.index("\n  --optim.lr") > text.index("\noptim:\n") > text.index("\n  --batch.epochs")


def test_presets_are_valid_configs():
    from ppo_lab.config import ALGORITHM_PRESETS, presets

    names = presets()
    assert {"gpt2-imdb", "qwen2.5-0.5b-sentiment", "openai-2019-sentiment", "n-plus-tldr", "tiny-rlhf-recipe"} <= set(names)
    for name in names:
        cfg = PPOConfig.from_yaml(name)
        # presets are the networked, full-size runs, except the tiny-* ones and chapter 10's
        # algorithms (run in the tests)
        assert (cfg.policy.model == "builtin:tiny") == (name.startswith("tiny-") or name in ALGORITHM_PRESETS)
    assert set(ALGORITHM_PRESETS) <= set(names)
    assert PPOConfig.from_yaml("gpt2-imdb", **{"run.iterations": 3}).run.iterations == 3
