import argparse

import pytest
import yaml

from ppo_lab.config import PPOConfig


def test_defaults_are_valid_and_documented():
    import dataclasses

    cfg = PPOConfig()
    for f in dataclasses.fields(cfg):
        assert f.metadata.get("help"), f"{f.name} has no help text"
    assert cfg.policy_model == "builtin:tiny"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(gamma=1.5), r"PPOConfig.gamma = 1.5 must be a finite number in \[0, 1\]"),
        (dict(lam=-0.1), r"PPOConfig.lam = -0.1 must be a finite number in \[0, 1\]"),
        (dict(learning_rate=0), r"PPOConfig.learning_rate = 0.0 must be a finite number in \(0, inf\)"),
        (dict(temperature=0), r"PPOConfig.temperature"),
        (dict(ppo_epochs=0), r"PPOConfig.ppo_epochs = 0 must be an integer >= 1"),
        (dict(critic="tied"), r"PPOConfig.critic = 'tied' is not allowed; valid values are: 'separate', 'shared', 'none'"),
        (dict(kl_estimator="k5"), r"PPOConfig.kl_estimator = 'k5' is not allowed; valid values are: 'k1', 'k2', 'k3', 'abs'"),
        (dict(advantage_estimator="vtrace"), r"PPOConfig.advantage_estimator = 'vtrace' is not allowed; valid values are: .*'gae'.*'grpo'"),
        (dict(loss_agg="sum"), r"PPOConfig.loss_agg = 'sum' is not allowed"),
        (dict(dual_clip=0.5), r"PPOConfig.dual_clip = 0.5 must be a finite number in \(1, inf\)"),
        (dict(rollout_batch_size=64, minibatch_size=24), r"rollout_batch_size = 64 is not divisible by minibatch_size = 24"),
        (dict(minibatch_size=16, gradient_accumulation_steps=3), r"minibatch_size = 16 is not divisible by gradient_accumulation_steps = 3"),
        (dict(rollout_batch_size=64, responses_per_prompt=3, minibatch_size=16), r"rollout_batch_size = 64 is not divisible by responses_per_prompt = 3"),
        (dict(advantage_estimator="grpo"), r"responses_per_prompt >= 2"),
        (dict(critic="none"), r"critic = 'none' cannot be used with advantage_estimator = 'gae'"),
        (dict(learning_rate="fast"), r"PPOConfig.learning_rate = 'fast' is not a valid float"),
        (dict(ppo_epochs=2.5), r"PPOConfig.ppo_epochs = 2.5 is not a valid int"),
        (dict(whiten_advantages="maybe"), r"PPOConfig.whiten_advantages = 'maybe' is not a valid bool"),
        (dict(task="chess"), r"PPOConfig.task = 'chess' is not allowed"),
        # inf passed the range check ("(0, inf)") and trained every weight to nan
        (dict(learning_rate=float("inf")), r"PPOConfig.learning_rate = inf must be a finite number in \(0, inf\)"),
        (dict(learning_rate="inf"), r"PPOConfig.learning_rate = inf must be a finite number"),
        (dict(max_grad_norm=float("inf")), r"PPOConfig.max_grad_norm = inf must be a finite number"),
        (dict(kl_coef=float("nan")), r"PPOConfig.kl_coef = nan must be a finite number"),
        (dict(forward_batch_size=0), r"PPOConfig.forward_batch_size = 0 must be an integer >= 1 \(or None\)"),
        # peft refuses it only after minutes of loading
        (dict(lora_dropout=1.0), r"PPOConfig.lora_dropout = 1.0 must be a finite number in \[0, 1\)"),
    ],
)
def test_invalid_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**kwargs)


def test_processes_must_divide_the_minibatch():
    cfg = PPOConfig(rollout_batch_size=48, minibatch_size=12)
    cfg.check_divisibility(processes=4)
    with pytest.raises(ValueError, match=r"minibatch_size = 12 is not divisible by gradient_accumulation_steps x processes = 8"):
        cfg.check_divisibility(processes=8)
    accumulating = PPOConfig(rollout_batch_size=48, minibatch_size=12, gradient_accumulation_steps=3)
    accumulating.check_divisibility(processes=2)
    with pytest.raises(ValueError, match=r"minibatch_size = 12 is not divisible by gradient_accumulation_steps x processes = 9"):
        accumulating.check_divisibility(processes=3)
    with pytest.raises(ValueError, match=r"rollout_batch_size = 48 is not divisible by the number of processes = 5"):
        PPOConfig(rollout_batch_size=48, minibatch_size=48, gradient_accumulation_steps=1).check_divisibility(processes=5)


def test_yaml_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"learning_rate": 1e-5, "critic": "shared", "score_clip": None, "total_iterations": 7}))
    cfg = PPOConfig.from_yaml(path, total_iterations="9")
    assert cfg.learning_rate == 1e-5 and cfg.critic == "shared" and cfg.total_iterations == 9 and cfg.score_clip is None
    cfg.to_yaml(tmp_path / "round.yaml")
    assert PPOConfig.from_yaml(tmp_path / "round.yaml") == cfg


def test_yaml_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        PPOConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        PPOConfig.from_yaml(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("learning_rat: 0.1\n")
    with pytest.raises(ValueError, match=r"unknown PPOConfig field\(s\): 'learning_rat' \(did you mean 'learning_rate'\?\)"):
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
    path.write_text("kl_coef: 0.3\nppo_epochs: 2\n")
    args = parser.parse_args(["--ppo-epochs", "3", "--whiten_advantages", "false", "--score_clip", "none", "--top_p", "0.9"])
    cfg = PPOConfig.from_args(str(path), args)
    assert (cfg.kl_coef, cfg.ppo_epochs, cfg.whiten_advantages, cfg.score_clip, cfg.top_p) == (0.3, 3, False, None, 0.9)
    with pytest.raises(SystemExit):
        parser.parse_args(["--critic", "tied"])


def test_presets_are_valid_configs():
    from ppo_lab.config import ALGORITHM_PRESETS, presets

    names = presets()
    assert {"gpt2-imdb", "qwen2.5-0.5b-sentiment", "openai-2019-sentiment", "n-plus-tldr", "tiny-rlhf-recipe"} <= set(names)
    for name in names:
        cfg = PPOConfig.from_yaml(name)
        # presets are the networked, full-size runs, except the tiny-* ones and chapter 10's
        # algorithms (run in the tests)
        assert (cfg.policy_model == "builtin:tiny") == (name.startswith("tiny-") or name in ALGORITHM_PRESETS)
    assert set(ALGORITHM_PRESETS) <= set(names)
    assert PPOConfig.from_yaml("gpt2-imdb", total_iterations=3).total_iterations == 3
