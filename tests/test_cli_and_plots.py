import json
import os
import subprocess
import sys

import yaml

from ppo_lab.plotting import DASHBOARD, load_metrics, plot_dashboard


def _run(args, cwd):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "ppo_lab.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_train_from_yaml_with_overrides(tiny_path, tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"rollout_batch_size": 16, "minibatch_size": 8, "ppo_epochs": 1, "total_iterations": 5, "max_new_tokens": 8}))
    out = _run(["train", str(cfg), "--total_iterations", "2", "--output_dir", str(tmp_path / "run"), "--progress_bar", "false", "--threads", "1"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Before training" in out.stdout and "After training" in out.stdout
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == 2  # the flag won over the file
    saved = yaml.safe_load(open(tmp_path / "run" / "config.yaml"))
    assert saved["ppo_epochs"] == 1 and saved["total_iterations"] == 2


def test_train_rejects_bad_values_before_loading_anything(tmp_path):
    out = _run(["train", "--gamma", "3"], tmp_path)
    assert out.returncode == 2 and "PPOConfig.gamma = 3.0 must be a finite number in [0, 1]" in out.stderr
    out = _run(["train", "--critic", "tied"], tmp_path)
    assert out.returncode == 2 and "invalid choice: 'tied'" in out.stderr


def test_train_help_lists_every_field():
    out = _run(["train", "--help"], None)
    for flag in ["--policy_model", "--kl_estimator", "--advantage_estimator", "--missing_eos_penalty"]:
        assert flag in out.stdout


def test_dashboard_draws_every_panel_for_each_run(tmp_path):
    for name, slope in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as fh:
            for i in range(1, 6):
                row = {key: slope * i for key, _ in DASHBOARD}
                row["iteration"] = i
                row["value/explained_variance"] = None if i == 1 else 0.5
                fh.write(json.dumps(row) + "\n")
    assert len(load_metrics(tmp_path / "a")) == 5
    fig = plot_dashboard([tmp_path / "a", tmp_path / "b" / "metrics.jsonl"], smooth=2)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == len(DASHBOARD)
    assert all(len(ax.lines) == 2 for ax in axes)
    assert len(axes[4].lines[0].get_xdata()) == 4  # the None is skipped, not plotted as 0
    assert axes[0].get_legend() is not None
