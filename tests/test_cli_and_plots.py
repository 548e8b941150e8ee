import json
import os
import subprocess
import sys

import yaml

import pytest
import torch

from ppo_lab.plotting import DASHBOARD, load_metrics, plot_dashboard, rollout_diagram


def _run(args, cwd):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "ppo_lab.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_train_from_yaml_with_overrides(tiny_path, tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({
        "batch.rollout": 16, "batch.minibatch": 8, "batch.epochs": 1, "run.iterations": 5,
        "sampling.max_new_tokens": 8,
    }))
    out = _run(["train", str(cfg), "--run.iterations", "2", "--run.output_dir", str(tmp_path / "run"), "--run.progress_bar", "false", "--threads", "1"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Before training" in out.stdout and "After training" in out.stdout
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == 2  # the flag won over the file
    saved = yaml.safe_load(open(tmp_path / "run" / "config.yaml"))
    assert saved["batch"]["epochs"] == 1 and saved["run"]["iterations"] == 2  # nested, one mapping per group


def test_train_rejects_bad_values_before_loading_anything(tmp_path):
    out = _run(["train", "--advantage.gamma", "3"], tmp_path)
    assert out.returncode == 2 and "advantage.gamma = 3.0 must be a finite number in [0, 1]" in out.stderr
    out = _run(["train", "--critic.design", "tied"], tmp_path)
    assert out.returncode == 2 and "invalid choice: 'tied'" in out.stderr


def test_train_help_lists_every_setting_under_its_group():
    from ppo_lab.config import GROUPS, PPOConfig

    out = _run(["train", "--help"], None).stdout
    for name in PPOConfig().flat():
        group, _ = name.split(".")
        assert out.index(f"\n{group}:\n") < out.index(f"\n  --{name}"), name  # listed under its group's heading
    assert [line[:-1] for line in out.splitlines() if line[:-1] in GROUPS and line.endswith(":")] == list(GROUPS)


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


def _rollout_tensors(B=5, T=7, P=3, n_real=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.full((B, 1), n_real)).float()
    return dict(
        response_ids=torch.randint(0, 400, (B, T), generator=g), mask=mask, query_ids=torch.zeros(B, P, dtype=torch.long),
        old_logprobs=-torch.rand(B, T, generator=g) * 4, ref_logprobs=-torch.rand(B, T, generator=g) * 4,
        values=torch.randn(B, T, generator=g), scores=torch.randn(B, generator=g), rewards=torch.randn(B, T, generator=g),
        advantages=torch.randn(B, T, generator=g), returns=torch.randn(B, T, generator=g),
    )


def _texts(fig):
    return {t.get_gid(): t for ax in fig.axes for t in ax.texts if t.get_gid()}


@pytest.mark.parametrize("with_critic", [True, False])
def test_rollout_diagram_labels_each_tensor_with_its_shape_and_its_values(with_critic):
    import matplotlib.pyplot as plt

    x = _rollout_tensors()
    if not with_critic:
        x["values"] = None
    tokens = ["disappointingly", "slow", "but", "kind", ".", "<eos>", "<pad>"]
    fig = rollout_diagram(prompt="the service was", tokens=tokens, row=2, kl_coef=0.05, reward_name="a rule", **x)
    texts = _texts(fig)
    for name in ["response_ids", "mask", "old_logprobs", "ref_logprobs", "values", "scores", "rewards", "advantages", "returns"]:
        if x[name] is None:
            assert f"{name}:label" not in texts and f"{name}:0" not in texts
            continue
        assert texts[f"{name}:label"].get_text() == f"{name} {tuple(x[name].shape)}"
    assert texts["scores:label"].get_text() == "scores (5,)"
    assert texts["old_logprobs:3"].get_text() == f"{x['old_logprobs'][2, 3].item():+.2f}"  # row 2, position 3
    assert texts["response_ids:6"].get_text() == str(x["response_ids"][2, 6].item())
    assert texts["mask:4"].get_text() == "1" and texts["mask:5"].get_text() == "0"
    assert texts["scores:0"].get_text() == f"{x['scores'][2].item():+.2f}"
    assert "0.05" in texts["rewards:note"].get_text()
    # who is trained: the policy and the critic; the reference and the reward are frozen
    status = {gid.split(":")[0]: t.get_text() for gid, t in texts.items() if gid.endswith(":status")}
    expected = {"policy": "trained", "reference": "frozen", "reward": "frozen"} | ({"critic": "trained"} if with_critic else {})
    assert status == expected
    _assert_no_text_overlaps(fig)
    assert [texts[f"token:{t}"].get_text() for t in range(7)] == tokens  # the long token whole (the header staggered)
    plt.close(fig)


def _assert_no_text_overlaps(fig):
    texts = _texts(fig)
    renderer = fig.canvas.get_renderer()
    boxes = [(gid, t.get_window_extent(renderer)) for gid, t in texts.items() if t.get_text()]
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1 :]:
            assert not box_a.overlaps(box_b), (a, b)


def test_rollout_diagram_fits_the_longest_words_of_the_tiny_model_at_its_longest_response():
    import matplotlib.pyplot as plt

    x = _rollout_tensors(T=12, n_real=11)
    words = ["disappointing", "restaurant", "delightful", "fantastic", "beautiful", "excellent", "enjoyable", "brilliant",
             "disappointing", "restaurant", ".", "<eos>"]
    fig = rollout_diagram(prompt="the restaurant was", tokens=words, **x)
    texts = _texts(fig)
    assert [texts[f"token:{t}"].get_text() for t in range(12)] == words  # every word whole, none cut
    assert min(texts[f"token:{t}"].get_fontsize() for t in range(12)) >= 7
    _assert_no_text_overlaps(fig)
    plt.close(fig)
