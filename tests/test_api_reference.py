"""The API reference, book/reference_api.md: every public name of `ppo_lab` has one entry, and no
entry names something the package no longer has.

What "public" means (the page says it in one sentence, book/_ext/api_reference.py implements it):

- the public modules are `ppo_lab` and the modules and subpackages directly under `ppo_lab/`
  whose names have no leading underscore (`ppo_lab.gae`, `ppo_lab.course`; not `ppo_lab._checks`,
  nor the modules inside `ppo_lab.course`, which it re-exports);
- a public module's public names are its `__all__` where it has one (`ppo_lab.lora`,
  `ppo_lab.course`), else the functions and classes it defines (their `__module__` is the
  module) whose names have no leading underscore;
- and every name in `ppo_lab.__all__` is public. Those that are functions or classes are the
  objects of a module's entries (`ppo_lab.compute_gae` is `ppo_lab.gae.compute_gae`); the others
  (constants, registries' methods: `KL_ESTIMATORS`, `register_policy_loss`, `__version__`) are
  documented under the public module that assigns them.

Each object is documented once, under that one name. The entries are written when the book is
built by the `{api-module}` directive (one per module on the page), so a new function of a
documented module needs no edit of the page; a new module does (the build warns, and
`test_every_public_module_has_one_section` fails). These tests compute the public names from
the package itself and check the directive's entries against them.
"""

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest
import yaml

import ppo_lab

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "reference_api.md"
sys.path.insert(0, str(ROOT / "book" / "_ext"))

import api_reference  # noqa: E402

ENTRY = re.compile(r"^\.\. auto(function|class|data|method|attribute|exception|module):: +(\S+)", re.M)
HAND_WRITTEN = re.compile(r"^(?:```\{auto(?:function|class|data|method|attribute|exception|module)\}|\.\. auto\w+::) +(\S+)", re.M)


def public_modules() -> list[str]:
    """From the files: ppo_lab/NAME.py and ppo_lab/NAME/__init__.py, NAME without a leading _."""
    package = Path(ppo_lab.__file__).parent
    names = [p.stem for p in package.glob("*.py")] + [p.parent.name for p in package.glob("*/__init__.py")]
    return ["ppo_lab"] + sorted(f"ppo_lab.{n}" for n in names if not n.startswith("_"))


def defines(module: str) -> set[str]:
    """The names a module's own source binds at its top level (assignments, defs, classes)."""
    mod = importlib.import_module(module)
    out = set()
    for node in ast.parse(Path(mod.__file__).read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out


def public_names() -> dict[str, object]:
    """{the full name a public name is documented under: its object}, by the definition above."""
    out = {}
    for module in public_modules():
        mod = importlib.import_module(module)
        if module != "ppo_lab" and hasattr(mod, "__all__"):
            names = list(mod.__all__)
        else:
            names = [n for n, o in vars(mod).items() if not n.startswith("_") and (inspect.isfunction(o) or inspect.isclass(o)) and o.__module__ == module]
        out.update({f"{module}.{n}": getattr(mod, n) for n in names})
    for name in ppo_lab.__all__:
        obj = getattr(ppo_lab, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            continue  # the object of a module's entry (checked below)
        homes = [m for m in public_modules() if name in defines(m)]
        assert len(homes) == 1, f"ppo_lab.{name} is assigned in {homes or 'no public module'}, not in one"
        out[f"{homes[0]}.{name}"] = obj
    return out


def resolve(full: str):
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = full.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(full)


@pytest.fixture(scope="module")
def sections() -> list[str]:
    """The modules the page documents, one `{api-module}` directive each, in the page's order."""
    return re.findall(r"^```\{api-module\} +(\S+)", PAGE.read_text(), re.M)


@pytest.fixture(scope="module")
def entries(sections) -> list[str]:
    """The full names of the entries the directive writes for the page, in order."""
    return [name for module in sections for _, name in ENTRY.findall(api_reference.module_rst(module))]


def test_every_public_module_has_one_section(sections):
    assert sorted(sections) == sorted(set(sections)), "a module is documented twice"
    assert sorted(sections) == public_modules()
    assert api_reference.public_modules() == public_modules()


def test_every_public_name_has_one_entry(entries):
    expected = public_names()
    assert len(entries) == len(set(entries)), [e for e in entries if entries.count(e) > 1]
    missing = sorted(set(expected) - set(entries))
    assert not missing, f"public names without an entry in {PAGE.name}: {missing}"
    extra = sorted(set(entries) - set(expected))
    assert not extra, f"entries of names that are not public by this file's definition: {extra}"
    assert len(entries) > 250  # (269 when the page was written)


def test_every_export_of_ppo_lab_is_the_object_of_an_entry(entries):
    documented = {}
    for full in entries:
        documented.setdefault(id(resolve(full)), []).append(full)
    for name in ppo_lab.__all__:
        found = [f for f in documented.get(id(getattr(ppo_lab, name)), []) if f.rsplit(".", 1)[1] == name]
        assert len(found) == 1, f"ppo_lab.{name} is documented as {found or 'nothing'}"
        assert api_reference.export_homes()[name] == found[0]
    assert len(ppo_lab.__all__) == len(api_reference.export_homes()) >= 70


def test_each_object_is_documented_once(entries):
    """A function or class re-exported by another public module is not documented twice."""
    seen = {}
    for full in entries:
        obj = resolve(full)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert id(obj) not in seen, f"{full} and {seen[id(obj)]} are one object"
            seen[id(obj)] = full


def test_no_page_documents_a_name_that_is_gone(sections, entries):
    for module in sections:
        assert module in public_modules(), f"{PAGE.name} documents {module}, which is not a public module"
    for full in entries:
        resolve(full)
    # an autodoc directive written by hand, on any page, names something that exists
    for page in sorted((ROOT / "book").glob("*.md")):
        for full in HAND_WRITTEN.findall(page.read_text()):
            resolve(full)


def test_every_entry_has_a_docstring(entries):
    """A function or class its docstring; a constant a `#:` comment (without one, autodoc would
    show the docstring of its type: dict's, tuple's)."""
    bare = []
    for full in entries:
        module, _, name = full.rpartition(".")
        obj = resolve(full)
        if callable(obj):
            bare += [] if inspect.getdoc(obj) and not (inspect.isclass(obj) and obj.__doc__.startswith(f"{name}(")) else [full]
        else:
            bare += [] if api_reference.module_doc_comment(module, name) else [full]
    assert bare == []


def test_a_new_public_function_gets_an_entry_with_no_edit_of_the_page(monkeypatch):
    """The entries are computed from the module when the book is built."""
    import ppo_lab.gae as gae

    def brand_new_estimate(x):
        """(B, T) nothing."""

    brand_new_estimate.__module__ = "ppo_lab.gae"
    monkeypatch.setattr(gae, "brand_new_estimate", brand_new_estimate, raising=False)
    api_reference.public_names.cache_clear()
    api_reference.documented.cache_clear()
    try:
        assert ".. autofunction:: ppo_lab.gae.brand_new_estimate" in api_reference.module_rst("ppo_lab.gae")
    finally:
        monkeypatch.undo()
        api_reference.public_names.cache_clear()
        api_reference.documented.cache_clear()


def test_the_page_is_in_the_manual_and_linked():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    part = next(p for p in toc["parts"] if p["caption"] == "Using ppo_lab")
    assert "book/reference_api" in [c["file"] for c in part["chapters"]]
    for page in ("guide_library.md", "intro.md"):
        assert "reference_api" in (ROOT / "book" / page).read_text(), f"book/{page} does not link the API reference"
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["sphinx"]["local_extensions"]["api_reference"] == "book/_ext"
    assert "sphinx.ext.autodoc" in config["sphinx"]["extra_extensions"]


def test_docstrings_become_restructured_text():
    """The docstrings' Markdown-style code and "Returns:" sections, as the reference shows them."""
    lines = api_reference.markdown_docstring(
        ["GAE, see `compute_gae` and `ppo_lab.masked_whiten`; |x| is `x`'s size.", "", "Returns:", "    advantages: (B, T) the", "        advantages.", "    returns: (B, T) the returns."]
    )
    assert lines[0] == (
        "GAE, see :py:obj:`compute_gae <ppo_lab.gae.compute_gae>` and "
        ":py:obj:`ppo_lab.masked_whiten <ppo_lab.masked.masked_whiten>`; \\|x\\| is ``x``'s size."
    )
    assert lines[2:] == [":returns:", "    * **advantages** -- (B, T) the", "      advantages.", "    * **returns** -- (B, T) the returns."]
    # an indented block after a blank line is preformatted; code in it stays as it is
    assert api_reference.markdown_docstring(["The loop:", "", "    x = `y`"]) == ["The loop::", "", "    x = `y`"]
