import importlib.metadata
import inspect
import re
import subprocess
import sys

import ppo_lab


def test_version_is_the_distribution_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", ppo_lab.__version__)
    assert importlib.metadata.version("ppo-lab") == ppo_lab.__version__


def test_every_export_exists():
    for name in ppo_lab.__all__:
        assert hasattr(ppo_lab, name), name


def test_tensor_functions_document_their_shapes():
    """House style: every public math function states its tensor shapes like (B, T) or (B,)."""
    for name in [n for n in ppo_lab.__all__ if n not in ppo_lab._LAZY] + ["bradley_terry_loss"]:
        obj = getattr(ppo_lab, name)
        if inspect.isfunction(obj) and name not in {"register_advantage_estimator", "get_advantage_estimator", "compute_advantages"}:
            doc = inspect.getdoc(obj) or ""
            assert re.search(r"\((B|N)[,)]", doc) or "any shape" in doc, f"{name} has no shapes in its docstring"


def test_every_module_names_its_chapter():
    import pkgutil

    for info in pkgutil.iter_modules(ppo_lab.__path__):
        if info.name.startswith("_") or info.name == "cli":
            continue
        doc = importlib.import_module(f"ppo_lab.{info.name}").__doc__ or ""
        assert re.search(r"[Cc]hapter \d+", doc), f"ppo_lab.{info.name} does not name its chapter"


def test_console_script_is_registered_and_runs():
    eps = importlib.metadata.entry_points(group="console_scripts")
    assert any(ep.name == "ppo-lab" and ep.value == "ppo_lab.cli:main" for ep in eps)
    out = subprocess.run([sys.executable, "-m", "ppo_lab.cli", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"ppo-lab {ppo_lab.__version__}"
    api = subprocess.run([sys.executable, "-m", "ppo_lab.cli", "api"], capture_output=True, text=True, check=True)
    assert "compute_gae" in api.stdout and "GAE advantages" in api.stdout


def test_tiny_pretraining_is_deterministic():
    """Two builds with the same settings give bit-identical weights (a small spec, for speed)."""
    import torch

    from ppo_lab.tiny import TinySpec, pretrain

    spec = TinySpec(n_sentiment=300, n_arithmetic=100, steps=15, batch_size=16)
    torch.set_num_threads(1)
    a, _ = pretrain(spec)
    b, _ = pretrain(spec)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c, _ = pretrain(TinySpec(n_sentiment=300, n_arithmetic=100, steps=15, batch_size=16, seed=1))
    assert any(not torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))
