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
        assert re.search(r"[Cc]hapter \d+|Appendix [A-Z]\b", doc), f"ppo_lab.{info.name} does not name its chapter (or appendix)"


def test_console_script_is_registered_and_runs():
    eps = importlib.metadata.entry_points(group="console_scripts")
    assert any(ep.name == "ppo-lab" and ep.value == "ppo_lab.cli:main" for ep in eps)
    out = subprocess.run([sys.executable, "-m", "ppo_lab.cli", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"ppo-lab {ppo_lab.__version__}"
    api = subprocess.run([sys.executable, "-m", "ppo_lab.cli", "api"], capture_output=True, text=True, check=True)
    assert "compute_gae" in api.stdout and "GAE advantages" in api.stdout




def test_pyproject_declares_every_package_ppo_lab_imports():
    """Colab installs only pyproject.toml's dependencies: a missing one breaks every chapter there."""
    import ast
    import importlib.metadata
    import re
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    declared = {
        re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0].lower().replace("_", "-")
        for dep in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    optional = {"myst_nb"}  # imported only inside try/except ImportError (glue in the book build)
    to_dist = importlib.metadata.packages_distributions()
    missing = set()
    for path in (root / "ppo_lab").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                sibling = (path.parent / f"{top}.py").exists()  # the course's checks import their helpers beside them
                if top in sys.stdlib_module_names or top == "ppo_lab" or top in optional or sibling:
                    continue
                dists = {d.lower().replace("_", "-") for d in to_dist.get(top, [top])}
                if not dists & declared:
                    missing.add(f"{top} ({path.name})")
    assert not missing, f"imported by ppo_lab but not in pyproject.toml's dependencies: {sorted(missing)}"
