"""Sphinx extension: the settings cheat sheet of Appendix E, made from `ppo_lab`'s own data.

The directive

    ```{settings-sheet}
    :group: kl
    ```

renders the table of the group `kl` (without `:group:`, one table per group, each under a
rubric): each setting's dotted name, `ppo_lab`'s default, its help (the first sentence of a long
one), the pages that name it, and the presets that set it to something else. Nothing in the
tables is written by hand, so they cannot drift from the code:

- the settings, their defaults and help come from the config groups (`ppo_lab.config.GROUPS`,
  `ppo_lab.fields.settings`);
- a preset's values come from its YAML file (`ppo_lab/presets/*.yaml`), which the README's
  "Beyond PPO" table is kept equal to, each value converted by its group as `PPOConfig` does;
- a setting's pages are the chapters and appendices A to C, in the order of `_toc.yml`, whose
  text names it: the dotted name right after a backtick or a quote (`` `kl.coef` ``,
  `` `kl.coef = 0.1` ``, `"kl.coef"`), after `config.` or `cfg.`, or as a flag (`--kl.coef`).
  The table lists the pages whose prose (the text outside code cells and code blocks) names it
  and sets in bold the one that names it most often, a chapter before an appendix; a setting
  named only in code cells, which set it without discussing it, is marked "code only".

`tests/test_settings_sheet.py` checks the data against `PPOConfig` and the README.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import yaml

# the published recipes first, then chapter 10's algorithms, then the other presets by name
RECIPE_PRESETS = ("openai-2019-sentiment", "n-plus-tldr", "tiny-rlhf-recipe")
# the pages whose text is searched for a setting: the chapters and appendices A to C
EXPLAINING = re.compile(r"^book/(ch\d+_\w+|appendix_[abc]_\w+)$")
HEADING = re.compile(r"^# +(\d+|[A-Z])\. ", re.M)
NONE = "-"


def toc_pages(root: Path) -> list[str]:
    """The docnames of `_toc.yml`, in the order of the book."""
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    out = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                out.append(entry["file"])
            walk(entry.get("sections"))
            walk(entry.get("chapters"))

    walk(toc.get("parts"))
    walk(toc.get("chapters"))
    return out


def page_source(root: Path, docname: str) -> Path:
    """The page's markdown source, or its notebook where the tree has no markdown (the student
    edition builds the chapters from their .ipynb twins)."""
    md = root / f"{docname}.md"
    return md if md.exists() else root / f"{docname}.ipynb"


def page_text(path: Path) -> str:
    if path.suffix == ".ipynb":
        parts = []
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            parts.append(source if cell["cell_type"] == "markdown" else f"```{{code-cell}}\n{source}\n```")
        return "\n".join(parts)
    return path.read_text(encoding="utf-8")


FENCE = re.compile(r"^\s*(`{3,}|~{3,}|:{3,})(.*)$")
LANGUAGES = re.compile(r"^\{code-cell\}|^[\w+-]+$")  # a code cell, or a code block in a language


def prose(text: str) -> str:
    """The page's text outside code: without its code cells and code blocks (a directive's body,
    an exercise's or a proof's, stays)."""
    out, stack = [], []  # the open fences: (fence, is code)
    for line in text.split("\n"):
        m = FENCE.match(line)
        closes = m and stack and not m.group(2).strip() and m.group(1)[0] == stack[-1][0][0] and len(m.group(1)) >= len(stack[-1][0])
        if stack and stack[-1][1]:  # inside code: only its closing fence counts
            if closes:
                stack.pop()
            continue
        if not m:
            out.append(line)
        elif closes:
            stack.pop()
        else:
            info = m.group(2).strip()
            stack.append((m.group(1), not info or bool(LANGUAGES.match(info))))
    return "\n".join(out)


def explaining_pages(root: Path) -> list[dict]:
    """[{docname, label ("chapter 5", "appendix A"), path, text, prose}] in the book's order; `text`
    and `prose` count the dotted names the whole page and its prose name (`names_in`)."""
    out = []
    for docname in toc_pages(root):
        if not EXPLAINING.match(docname):
            continue
        path = page_source(root, docname)
        text = page_text(path)
        number = HEADING.search(text)
        if number is None:
            raise ValueError(f"{path}: no title of the form '# 5. ...' or '# A. ...' to number the page by")
        kind = "chapter" if number.group(1).isdigit() else "appendix"
        out.append({"docname": docname, "label": f"{kind} {number.group(1)}", "path": path, "text": names_in(text), "prose": names_in(prose(text))})
    return out


# a dotted name right after a backtick or a quote, after `config.` or `cfg.`, or after `--` (a
# flag, spelt with `_` or `-`); a lookahead, so that `"config.kl.coef"` yields `kl.coef` too
NAMED = re.compile(r"(?=([`\"']|\bconfig\.|\bcfg\.|--)([a-z]+\.[\w-]+))")


def names_in(text: str) -> Counter:
    """How often `text` names each dotted name (a longer name is not its prefix: `loss.clip_eps_high`
    does not name `loss.clip_eps`)."""
    return Counter(name.replace("-", "_") if before == "--" else name for before, name in NAMED.findall(text))


def preset_order() -> list[str]:
    from ppo_lab.config import ALGORITHM_PRESETS, presets

    names = presets()
    order = [p for p in RECIPE_PRESETS + tuple(ALGORITHM_PRESETS) if p in names]
    return order + [p for p in names if p not in order]


def preset_values(name: str) -> dict:
    """{dotted name: value} for each setting the preset's YAML file sets, converted to the field's
    type by its group (as `PPOConfig.from_yaml` converts it)."""
    from ppo_lab.config import GROUPS, PRESETS, nest

    data = yaml.safe_load((PRESETS / f"{name}.yaml").read_text()) or {}
    out = {}
    for key, fields in nest(data).items():
        built = GROUPS[key](**fields)
        out.update({f"{key}.{field}": getattr(built, field) for field in fields})
    return out


def first_sentence(text: str, short: int = 160) -> str:
    """A help text of at most `short` characters, else up to the end of its first sentence (a
    period followed by a space, outside brackets, not in "e.g." or "i.e.")."""
    if len(text) <= short:
        return text
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "(["
        depth -= ch in ")]"
        if ch == "." and depth == 0 and (i + 1 == len(text) or text[i + 1] == " ") and not re.search(r"\b(e\.g|i\.e)$", text[:i]):
            return text[: i + 1]
    return text


def sheet(root: Path) -> list[dict]:
    """The cheat sheet's data, group by group in `PPOConfig`'s order: [{key, doc, settings}], each
    setting {name, default, help, mentions, explained_in, presets}. `mentions`: the pages that
    name it, in the book's order, each {docname, label, prose, all} with the count of mentions in
    its prose and in its whole text; `explained_in`: one of them or None (`explained_in()`);
    `presets`: {preset: value} for the presets whose value differs from the default, in the order
    of `preset_order()` (every value each preset sets, default or not, is in `sheet_presets()`)."""
    import dataclasses

    from ppo_lab.config import GROUPS
    from ppo_lab.fields import settings

    pages = explaining_pages(root)
    values = {p: preset_values(p) for p in preset_order()}
    out = []
    for key, cls in GROUPS.items():
        rows = []
        for f in settings(cls):
            name = f"{key}.{f.name}"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            found = [{"docname": p["docname"], "label": p["label"], "prose": p["prose"][name], "all": p["text"][name]} for p in pages]
            found = [p for p in found if p["all"]]
            rows.append({
                "name": name,
                "default": default,
                "help": f.metadata["help"],
                "mentions": found,
                "explained_in": explained_in(found),
                "presets": {p: v[name] for p, v in values.items() if name in v and not same(v[name], default)},
            })
        out.append({"key": key, "doc": (cls.__doc__ or "").strip().split("\n\n")[0], "settings": rows})
    return out


def explained_in(mentions: list[dict]) -> dict | None:
    """The page that explains a setting: of the pages whose prose names it, the one that names it
    most often, a chapter before an appendix (the appendices point at settings as remedies; the
    chapters explain them), the first of a tie; None when no page's prose names it."""
    named = [m for m in mentions if m["prose"]]
    return max(named, key=lambda m: (m["label"].startswith("chapter"), m["prose"]), default=None)


def sheet_presets() -> dict[str, dict]:
    """{preset: {dotted name: value}}: every value each preset file sets, default or not."""
    return {p: preset_values(p) for p in preset_order()}


def same(a, b) -> bool:
    """Equal and of one type (so that `true` is not `1`)."""
    return type(a) is type(b) and a == b


# --- rendering ----------------------------------------------------------------------------------
def format_value(v) -> str:
    """A value as YAML writes it (`null`, `true`, `1e-5`), as inline code."""
    if v is None:
        s = "null"
    elif isinstance(v, bool):
        s = "true" if v else "false"
    elif isinstance(v, float):
        s = repr(v)
        if v and abs(v) < 1e-3:  # 3e-4, as the presets and the chapters write it, not 0.0003
            mantissa, exponent = f"{v:.12e}".split("e")
            s = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    elif isinstance(v, str):
        plain = re.fullmatch(r"[\w./:@+<>-]*\w[\w./:@+<>-]*", v) and yaml.safe_load(v) == v
        s = v if plain else json.dumps(v)
    else:
        s = str(v)
    return code(s)


def code(s: str) -> str:
    return f"`{s.replace('|', chr(92) + '|')}`"


def escape(text: str) -> str:
    """Text for a table cell, on one line, with markdown's own characters escaped outside its
    `code` spans (a docstring marks code so)."""
    parts = " ".join(text.split()).split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: all of it is text
        parts = ["`".join(parts)]
    return "".join(code(p) if i % 2 else re.sub(r"([\\`*_\[\]<>$|~{}#])", r"\\\1", p) for i, p in enumerate(parts))


def link(page: dict) -> str:
    """{doc}`5 </book/ch05_...>`: a chapter by its number, an appendix by its letter."""
    return f"{{doc}}`{page['label'].split()[-1]} </{page['docname']}>`"


def pages_cell(setting: dict, most: int = 3) -> str:
    """The pages whose prose names the setting, in the book's order, the one that explains it in
    bold; else, marked so, the first `most` pages whose code names it; else NONE."""
    named = [m for m in setting["mentions"] if m["prose"]]
    if named:
        main = setting["explained_in"]["docname"]
        return ", ".join(f"**{link(m)}**" if m["docname"] == main else link(m) for m in named)
    if setting["mentions"]:
        shown = ", ".join(link(m) for m in setting["mentions"][:most])
        more = len(setting["mentions"]) - most
        return f"code only: {shown}" + (f" and {more} more" if more > 0 else "")
    return NONE


def presets_cell(presets: dict, folder_pattern: int = 3) -> str:
    """`0.05` in `ppo`, `rloo`; ...: the presets grouped by value, in the presets' order. Paths that
    end in their preset's own name (`runs/grpo` in `grpo`) are grouped as one pattern
    (`runs/<preset>`) when at least `folder_pattern` presets share it."""
    if not presets:
        return NONE

    def pattern(preset, value):
        if isinstance(value, str) and re.search(rf"/{re.escape(preset)}$", value):
            return code(value[: -len(preset)] + "<preset>")
        return None

    counts: dict[str, int] = {}
    for preset, value in presets.items():
        if pattern(preset, value):
            counts[pattern(preset, value)] = counts.get(pattern(preset, value), 0) + 1
    groups: dict[str, list[str]] = {}
    for preset, value in presets.items():
        shown = pattern(preset, value)
        if shown is None or counts[shown] < folder_pattern:
            shown = format_value(value)
        groups.setdefault(shown, []).append(preset)
    everyone = len(preset_order())
    parts = []
    for shown, names in groups.items():
        where = "every preset" if len(names) == everyone else ", ".join(code(n) for n in names)
        parts.append(f"{shown} in {where}")
    return "; ".join(parts)


COLUMNS = ("setting", "default", "what it does", "chapters", "presets that change it")


def group_markdown(group: dict, rubric: bool = False) -> str:
    """One group's table, as MyST markdown."""
    lines = []
    if rubric:
        lines += [f"```{{rubric}} {group['key']}", "```", ""]
    lines += [escape(group["doc"]), ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for s in group["settings"]:
        cells = [code(s["name"]), format_value(s["default"]), escape(first_sentence(s["help"])), pages_cell(s), presets_cell(s["presets"])]
        assert all("\n" not in c for c in cells), cells
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def sheet_markdown(root: Path, group: str | None = None) -> str:
    groups = sheet(root)
    if group is not None:
        found = [g for g in groups if g["key"] == group]
        if not found:
            raise ValueError(f"settings-sheet: unknown group {group!r}; the groups are {', '.join(g['key'] for g in groups)}")
        return group_markdown(found[0])
    return "\n".join(group_markdown(g, rubric=True) for g in groups)


# --- the directive ------------------------------------------------------------------------------
def setup(app):
    from docutils import nodes
    from docutils.parsers.rst import directives
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective

    class SettingsSheet(SphinxDirective):
        """`{settings-sheet}`: the tables of the settings (`:group: NAME` for one group's)."""

        has_content = False
        option_spec = {"group": directives.unchanged_required}

        def run(self):
            import ppo_lab.config as config

            root = Path(self.env.srcdir)
            # the page is read again when a page it searches, a preset or the config changes
            read = [page["path"] for page in explaining_pages(root)] + [root / "_toc.yml"] + sorted(config.PRESETS.glob("*.yaml"))
            read += [Path(config.__file__).with_name(f) for f in ("config.py", "config_groups.py", "fields.py", "sampling.py")]
            for path in read:
                self.env.note_dependency(str(path))
            try:
                text = sheet_markdown(root, self.options.get("group"))
            except ValueError as err:
                raise self.error(str(err)) from None
            container = nodes.container(classes=["settings-sheet"])
            self.state.nested_parse(StringList(text.split("\n"), source=self.env.docname), self.content_offset, container)
            return [container]

    app.add_directive("settings-sheet", SettingsSheet)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
