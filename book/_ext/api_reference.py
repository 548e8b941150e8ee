"""Sphinx extension: the API reference of `ppo_lab` (book/reference_api.md), made from the package.

The directive

    ```{api-module} ppo_lab.gae
    ```

documents every public name of one module with autodoc, in the order of its source, each under
one name: `ppo_lab.gae.compute_gae`, where the module defines it (a name `ppo_lab` exports says so
under its entry). A new public function appears with no edit of the page; a new public module is
reported by the build (a warning, which `-W` makes an error) until the page gives it a section.

What "public" means is written once, in `tests/test_api_reference.py`, which checks this
extension's entries against it: `public_modules()` and `public_names()` below implement it.

The docstrings are written for `help()` and in the book's Markdown habits: `code` in single
backticks, formulas and loops indented, Google-style "Args:" and "Returns:" sections. Before
napoleon reads them, `markdown_docstring` makes each `name` inline code (a link where it names a
documented object), an indented block preformatted text, and a "Returns:" section a field (an item
per named result: `advantages: (B, T) ...`). Each module's section opens with the first paragraph
of its docstring, and shows the rest, made reStructuredText the same way, in a dropdown.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
from functools import lru_cache
from pathlib import Path

PACKAGE = "ppo_lab"


# --- what is documented -------------------------------------------------------------------------
def public_modules() -> list[str]:
    """`ppo_lab` and its modules and subpackages whose name has no leading underscore."""
    package = importlib.import_module(PACKAGE)
    found = pkgutil.iter_modules(package.__path__)
    return [PACKAGE] + sorted(f"{PACKAGE}.{m.name}" for m in found if not m.name.startswith("_"))


@lru_cache(maxsize=None)
def assigned(module: str) -> frozenset[str]:
    """The names a module's source assigns at its top level (`X = ...`, `X: T = ...`)."""
    mod = importlib.import_module(module)
    tree = ast.parse(Path(mod.__file__).read_text(encoding="utf-8"))
    out = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        out.update(t.id for t in targets if isinstance(t, ast.Name))
    return frozenset(out)


def exported() -> list[str]:
    """`ppo_lab.__all__`."""
    return list(importlib.import_module(PACKAGE).__all__)


@lru_cache(maxsize=None)
def public_names(module: str) -> tuple[str, ...]:
    """The names documented under `module`: its `__all__` where it has one (not `ppo_lab`, whose
    `__all__` lists what it re-exports), else the functions and classes it defines whose names
    have no leading underscore, in the order of its source; and the names of `ppo_lab.__all__`
    that are not functions or classes (constants, registries' methods) where the module assigns
    them."""
    mod = importlib.import_module(module)
    if module != PACKAGE and hasattr(mod, "__all__"):
        names = list(mod.__all__)
    else:
        names = [
            n for n, obj in vars(mod).items()
            if not n.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module
        ]
    package = importlib.import_module(PACKAGE)
    for name in exported():
        obj = getattr(package, name)
        if name not in names and not (inspect.isfunction(obj) or inspect.isclass(obj)) and name in assigned(module):
            names.append(name)
    return tuple(names)


@lru_cache(maxsize=None)
def documented() -> dict[str, str]:
    """{full name: kind} of every documented object, kind "function", "class" or "data"."""
    out = {}
    for module in public_modules():
        mod = importlib.import_module(module)
        for name in public_names(module):
            obj = getattr(mod, name)
            kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "data"
            out[f"{module}.{name}"] = kind
    return out


@lru_cache(maxsize=None)
def export_homes() -> dict[str, str]:
    """{name in `ppo_lab.__all__`: the full name it is documented under}."""
    package = importlib.import_module(PACKAGE)
    out = {}
    for name in exported():
        obj = getattr(package, name)
        for full in documented():
            module, _, short = full.rpartition(".")
            if short == name and getattr(importlib.import_module(module), short) is obj:
                out[name] = full
                break
    return out


@lru_cache(maxsize=None)
def targets() -> dict[str, str]:
    """How a docstring may name a documented object -> its full name: `ppo_lab.gae.compute_gae`,
    `gae.compute_gae`, `ppo_lab.compute_gae` for an exported name, and the bare name where one
    object has it and it cannot be read as a word (it holds an underscore or a capital)."""
    out, bare = {}, {}
    for full in documented():
        module, _, short = full.rpartition(".")
        out[full] = full
        out[f"{module.rpartition('.')[2]}.{short}"] = full
        bare.setdefault(short, []).append(full)
    for name, full in export_homes().items():
        out[f"{PACKAGE}.{name}"] = full
    for short, fulls in bare.items():
        if len(fulls) == 1 and re.search(r"[_A-Z]", short.strip("_")):
            out.setdefault(short, fulls[0])
    return out


# --- docstrings: Markdown-style code and "Returns:" to reStructuredText --------------------------
SPAN = re.compile(r"``.+?``|:[\w:.-]+:`[^`]+`|`([^`]+?)`(_{0,2})")


def inline(text: str) -> str:
    """`x` -> ``x`` (or a link to the documented object `x` names), outside reST's own code and
    roles; a span glued to a word (`Rollout`s) is kept apart from it with an escaped space. A `|`
    outside code is a character, not a substitution (`|log r|`)."""
    out, at = [], 0
    for m in SPAN.finditer(text):
        out.append(text[at:m.start()].replace("|", "\\|"))
        at = m.end()
        if m.group(1) is None or m.group(2) or "\n\n" in m.group(1):
            out.append(m.group(0))
            continue
        code = m.group(1)
        name = re.sub(r"\(\)$", "", code)
        if name in targets():
            span = f":py:obj:`{code} <{targets()[name]}>`"
        else:
            span = f"``{code}``" if code.strip() == code else f":code:`{code}`"
        before = text[m.start() - 1] if m.start() else " "
        after = text[m.end()] if m.end() < len(text) else " "
        out.append(("\\ " if before.isalnum() else "") + span + ("\\ " if after.isalnum() else ""))
    out.append(text[at:].replace("|", "\\|"))
    return "".join(out)


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def blocks(lines: list[str]) -> list[tuple[bool, list[str]]]:
    """The lines cut into runs of text and of literal blocks (after a `::`, and `>>>` examples):
    [(is_literal, lines)]."""
    out, literal, opener = [], False, None
    for line in lines:
        if literal:
            if line.strip() and indent_of(line) <= opener and not line.lstrip().startswith(">>>"):
                literal = False
        elif line.lstrip().startswith(">>>"):
            literal, opener = True, indent_of(line) - 1
        if not out or out[-1][0] != literal:
            out.append((literal, []))
        out[-1][1].append(line)
        if not literal and line.rstrip().endswith("::") and not line.lstrip().startswith(".."):
            literal, opener = True, indent_of(line)
    return out


NAMED_RESULT = re.compile(r'^([A-Za-z_]\w*(?:, [A-Za-z_]\w*)*|\w+="[\w-]+"): ')


def returns_field(lines: list[str]) -> list[str]:
    """A Google-style "Returns:" section as a `:returns:` field: an item per named result
    (`loss: 0-dim tensor.` -> **loss** -- 0-dim tensor.), else the text as it is. A line that
    continues an item or the text is its paragraph's, however it is indented."""
    body = [line.strip() for line in lines]
    while body and not body[-1]:
        body.pop()
    if not NAMED_RESULT.match(body[0]):
        return [":returns:"] + [f"    {line}" if line else "" for line in body]
    out = [":returns:"]
    for line in body:
        m = NAMED_RESULT.match(line)
        if m:
            name = f"``{m.group(1)}``" if "=" in m.group(1) else f"**{m.group(1)}**"  # level="token"
            out.append(f"    * {name} -- {line[m.end():]}")
        else:
            out.append(f"      {line}" if line else "")
    return out


SECTION = re.compile(
    r"^\s*(Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Other Parameters|Returns?|Yields?|"
    r"Raises|Warns|Attributes|Methods|Examples?|Notes?|Warnings?|See Also|Todo|References):\s*$|^\s*:\w+:"
)


def markdown_docstring(lines: list[str]) -> list[str]:
    """A docstring's lines as reStructuredText that napoleon reads: each "Returns:" section made a
    `:returns:` field, the text around the sections as `plain_docstring` makes it, and `code`
    made inline code (or a link)."""
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == "Returns:":
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or indent_of(lines[j]) > indent_of(line)):
                j += 1
            section = lines[i + 1:j]
            while section and not section[-1].strip():
                section.pop()
                j -= 1
            if any(s.strip() for s in section):
                out += [" " * indent_of(line) + s if s else "" for s in returns_field(section)]
                i = j
                continue
        out.append(line)
        i += 1
    # the sections (a header, or a field, and the lines indented under it) as they are; the text
    # between them made reStructuredText
    parts, text, i = [], [], 0
    while i < len(out):
        if SECTION.match(out[i]):
            j = i + 1
            while j < len(out) and (not out[j].strip() or indent_of(out[j]) > indent_of(out[i])):
                j += 1
            while j > i + 1 and not out[j - 1].strip():
                j -= 1
            parts += plain_docstring(text) + out[i:j]
            text, i = [], j
        else:
            text.append(out[i])
            i += 1
    parts += plain_docstring(text)
    converted = []
    for literal, run in blocks(parts):
        converted += run if literal else inline("\n".join(run)).split("\n")
    return converted


# --- docstrings: plain text to reStructuredText -------------------------------------------------
LIST_ITEM = re.compile(r"^(\d+\.|[-*]) ")
TABLE_RULE = re.compile(r"^\|(\s*:?-+:?\s*\|)+$")


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def list_table(rows: list[str]) -> list[str]:
    """A Markdown table (a header, a `|---|` rule, rows) as a `list-table`."""
    out = [".. list-table::", "   :header-rows: 1", ""]
    for row in [rows[0]] + rows[2:]:
        for i, cell in enumerate(cells(row)):
            out.append(("   * - " if i == 0 else "     - ") + cell)
    return out + [""]


def plain_docstring(lines: list[str]) -> list[str]:
    """Docstring text written as plain text (for `help()`) in reStructuredText: an indented
    block is preformatted (a formula, a loop, a command), a list may follow its paragraph without
    a blank line, a Markdown table becomes a table."""
    out, i, in_list = [], 0, False
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            out.append(line)
            i += 1
            continue
        if line.startswith("|") and i + 1 < len(lines) and TABLE_RULE.match(lines[i + 1].strip()):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out += ([""] if out and out[-1].strip() else []) + list_table(lines[i:j])
            i, in_list = j, False
            continue
        if indent_of(line) and not in_list and (not out or not out[-1].strip()):
            j = i
            while j < len(lines) and (not lines[j].strip() or indent_of(lines[j])):
                j += 1
            while out and not out[-1].strip():
                out.pop()
            if out and out[-1].rstrip().endswith(":") and not out[-1].rstrip().endswith("::"):
                out[-1] = out[-1].rstrip() + ":"
            elif not (out and out[-1].rstrip().endswith("::")):
                out += ["", "::"]
            out += [""] + [l.rstrip() for l in lines[i:j]]
            i = j
            continue
        if LIST_ITEM.match(line):
            if out and out[-1].strip() and not in_list:
                out.append("")
            in_list = True
        elif not indent_of(line):
            if in_list and out and out[-1].strip():
                out.append("")  # a paragraph after a list
            in_list = False
        out.append(line)
        i += 1
    return out


# --- the reStructuredText of one module ----------------------------------------------------------
def summary(module: str) -> str:
    """The first paragraph of the module's docstring, on one line."""
    doc = inspect.getdoc(importlib.import_module(module)) or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def module_rst(module: str) -> str:
    """The module's entries, as reStructuredText (autodoc directives)."""
    mod = importlib.import_module(module)
    homes = {full: name for name, full in export_homes().items()}
    lines = [f".. py:module:: {module}", "", inline(summary(module)), ""]
    rest = (inspect.getdoc(mod) or "").strip().split("\n\n", 1)[1:]
    if rest and module != PACKAGE:  # (the package's is the table of modules this page is made of)
        text = markdown_docstring(rest[0].split("\n"))
        lines += [".. admonition:: More from the module's docstring", "   :class: dropdown", ""]
        lines += [f"   {line}" if line.strip() else "" for line in text] + [""]
    if module == PACKAGE:
        names = sorted(export_homes(), key=lambda n: n.strip("_").lower())
        links = ", ".join(f":py:obj:`{n} <{export_homes()[n]}>`" for n in names)
        lines += [f"``{PACKAGE}`` exports these {len(names)} names, each documented below under the module that defines it: {links}.", ""]
    for name in public_names(module):
        full = f"{module}.{name}"
        kind = documented()[full]
        obj = getattr(mod, name)
        if kind == "class":
            lines += [f".. autoclass:: {full}", "   :members:"]
            if obj.__bases__ != (object,):
                lines += ["   :show-inheritance:"]
        elif kind == "function":
            lines += [f".. autofunction:: {full}"]
        else:
            lines += [f".. autodata:: {full}"]
            if " at 0x" in repr(obj) or len(repr(obj)) > 100:
                lines += ["   :no-value:"]
        if full in homes and module != PACKAGE:
            lines += ["", f"   Also ``{PACKAGE}.{homes[full]}``."]
        lines += [""]
    return "\n".join(lines)


def module_doc_comment(module: str, name: str) -> str | None:
    """The `#:` comment that documents a module-level constant, if any."""
    from sphinx.pycode import ModuleAnalyzer

    analyzer = ModuleAnalyzer.for_module(module)
    return "\n".join(analyzer.find_attr_docs().get(("", name), [])) or None


# --- the directive ------------------------------------------------------------------------------
def setup(app):
    from docutils import nodes
    from docutils.statemachine import StringList
    from sphinx.util import logging
    from sphinx.util.docutils import SphinxDirective

    logger = logging.getLogger(__name__)

    class ApiModule(SphinxDirective):
        """`{api-module} ppo_lab.NAME`: the module's public names, with autodoc."""

        required_arguments = 1
        has_content = False

        def run(self):
            module = self.arguments[0]
            if module not in public_modules():
                raise self.error(f"api-module: {module!r} is not a public module of {PACKAGE}; they are {', '.join(public_modules())}")
            seen = self.env.api_reference.setdefault(self.env.docname, [])
            seen.append(module)
            self.env.note_dependency(importlib.import_module(module).__file__)
            for name in public_names(module):
                if documented()[f"{module}.{name}"] == "data" and not module_doc_comment(module, name):
                    logger.warning(f"api-module: {module}.{name} has no `#:` comment to document it", location=self.get_location())
            text = f"````{{eval-rst}}\n{module_rst(module)}\n````"
            container = nodes.container(classes=["api-module"])
            self.state.nested_parse(StringList(text.split("\n"), source=self.env.docname), self.content_offset, container)
            return [container]

    def init(app, env, docnames):
        if not hasattr(env, "api_reference"):
            env.api_reference = {}  # {docname: [the modules its api-module directives document]}

    def purge(app, env, docname):
        getattr(env, "api_reference", {}).pop(docname, None)

    def merge(app, env, docnames, other):
        init(app, env, docnames)
        env.api_reference.update({d: m for d, m in getattr(other, "api_reference", {}).items() if d in docnames})

    def docstring(app, what, name, obj, options, lines):
        lines[:] = markdown_docstring(lines)

    def signature(app, what, name, obj, options, sig, return_annotation):
        """A dataclass field's default factory by name (`policy: Policy = Policy()`), where
        autodoc writes `<factory>`, which is not Python and leaves the signature unparsed."""
        if what != "class" or not sig or "<factory>" not in sig or not dataclasses.is_dataclass(obj):
            return None
        for f in dataclasses.fields(obj):
            factory = getattr(f.default_factory, "__name__", "<lambda>")
            made = f"{factory}()" if factory.isidentifier() else "..."
            sig = re.sub(rf"(\b{f.name}: [^=]+? = )<factory>", rf"\g<1>{made}", sig)
        return sig, return_annotation

    def check(app, env):
        """Every public module documented once."""
        where = {}
        for docname, modules in getattr(env, "api_reference", {}).items():
            for module in modules:
                where.setdefault(module, []).append(docname)
        if not where:
            return  # a build without the reference page
        for module in public_modules():
            if module not in where:
                logger.warning(f"api-module: {module} is public but no page documents it (add a section with ```{{api-module}} {module}``` to book/reference_api.md)")
            elif len(where[module]) > 1:
                logger.warning(f"api-module: {module} is documented twice ({', '.join(where[module])})")

    app.setup_extension("sphinx.ext.autodoc")
    app.setup_extension("sphinx.ext.napoleon")
    app.add_directive("api-module", ApiModule)
    app.connect("env-before-read-docs", init)
    app.connect("env-purge-doc", purge)
    app.connect("env-merge-info", merge)
    app.connect("env-check-consistency", check)
    # before napoleon's (priority 500), which reads the sections this makes
    app.connect("autodoc-process-docstring", docstring, priority=400)
    app.connect("autodoc-process-signature", signature)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
