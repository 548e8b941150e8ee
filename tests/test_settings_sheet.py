"""Appendix E, the settings cheat sheet: its tables (made by book/_ext/settings_sheet.py when the
book is built) hold every setting once, `PPOConfig`'s defaults, the presets' values as
`PPOConfig.from_yaml` reads them, and the values of the "Beyond PPO" table of book/guide_algorithms.md."""

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import yaml

from ppo_lab.config import GROUPS, PPOConfig, presets
from ppo_lab.fields import settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))

import settings_sheet  # noqa: E402

PAGE = ROOT / "book" / "appendix_e_settings.md"


@pytest.fixture(scope="module")
def sheet():
    return settings_sheet.sheet(ROOT)


def rows(sheet):
    return {s["name"]: s for group in sheet for s in group["settings"]}


def test_every_setting_of_every_group_appears_once_in_the_config_order(sheet):
    groups = [f.name for f in dataclasses.fields(PPOConfig)]
    assert [g["key"] for g in sheet] == groups == list(GROUPS) and len(groups) == 14
    names = [s["name"] for group in sheet for s in group["settings"]]
    assert names == [f"{key}.{f.name}" for key, cls in GROUPS.items() for f in settings(cls)]
    assert len(set(names)) == len(names) == len(PPOConfig().flat())


def test_every_default_is_the_configs(sheet):
    defaults = PPOConfig().flat()
    for name, s in rows(sheet).items():
        assert settings_sheet.same(s["default"], defaults[name]), name


def test_the_presets_values_are_what_from_yaml_reads(sheet):
    """A preset is listed under a setting exactly when its config's value differs from the
    default, with that value; every value a preset file sets is its config's."""
    assert settings_sheet.preset_order()[:3] == list(settings_sheet.RECIPE_PRESETS)
    assert sorted(settings_sheet.preset_order()) == presets()
    defaults, table, files = PPOConfig().flat(), rows(sheet), settings_sheet.sheet_presets()
    for preset in presets():
        config = PPOConfig.from_yaml(preset).flat()
        changed = {name: v for name, v in config.items() if not settings_sheet.same(v, defaults[name])}
        shown = {name: s["presets"][preset] for name, s in table.items() if preset in s["presets"]}
        assert changed.keys() == shown.keys(), preset
        assert all(settings_sheet.same(shown[name], v) for name, v in changed.items()), preset
        assert all(settings_sheet.same(config[name], v) for name, v in files[preset].items()), preset


def test_the_readme_preset_table_agrees_with_the_sheet(sheet):
    """book/guide_algorithms.md, "Beyond PPO": each `field: value` of a preset's row is the value the sheet has for
    that preset, and shown in the preset's column where it is not the default."""
    section = (ROOT / "book" / "guide_algorithms.md").read_text().split("## Beyond PPO", 1)[1].split("\n## ", 1)[0]
    readme = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_]+)` \| [^|]+ \| (.+) \|$", section, flags=re.M)}
    assert readme, "no preset rows found in the Beyond PPO table of book/guide_algorithms.md"
    table, files = rows(sheet), settings_sheet.sheet_presets()
    for preset, cell in readme.items():
        for item in re.findall(r"`([^`]+)`", cell):
            name, value = item.split(": ", 1)
            value = yaml.safe_load(value)
            assert files[preset][name] == value, (preset, name)
            if files[preset][name] != table[name]["default"]:
                assert table[name]["presets"][preset] == value, (preset, name)
                assert f"`{preset}`" in settings_sheet.presets_cell(table[name]["presets"]), (preset, name)


def test_the_tables_are_well_formed_markdown(sheet):
    text = settings_sheet.sheet_markdown(ROOT)
    table_rows = [line for line in text.split("\n") if line.startswith("|")]
    assert len(table_rows) == len(rows(sheet)) + 2 * len(sheet)
    for line in table_rows:
        assert len(re.split(r"(?<!\\)\|", line)) == len(settings_sheet.COLUMNS) + 2, line
    assert "\\|\\|" in text  # the help of optim.early_stop_kl, "KL(old || new)", escaped
    with pytest.raises(ValueError, match="unknown group 'klx'"):
        settings_sheet.sheet_markdown(ROOT, "klx")


def test_the_page_has_one_table_per_group_and_names_every_preset():
    text = PAGE.read_text()
    assert re.findall(r"```\{settings-sheet\}\n:group: (\w+)\n```", text) == list(GROUPS)
    listed = text.split("## The presets", 1)[1].split("\n## `", 1)[0]
    assert set(re.findall(r"^- `([^`]+)`:", listed, flags=re.M)) == set(presets())
    toc = settings_sheet.toc_pages(ROOT)
    assert toc.index("book/appendix_e_settings") == toc.index("book/appendix_d_instructors") + 1


def test_a_settings_chapters_are_the_pages_that_name_it(sheet):
    table = rows(sheet)
    main = {name: (table[name]["explained_in"] or {}).get("docname") for name in table}
    assert main["kl.coef"] == "book/ch05_reward_shaping_and_kl"
    assert main["loss.clip_eps"] == "book/ch06_clipping"
    assert main["sampler.noise"] == "book/ch09_scaling_up"
    pages = [p["docname"] for p in settings_sheet.explaining_pages(ROOT)]
    assert pages[0] == "book/ch01_rl_for_language_models" and pages[-1] == "book/appendix_c_failures" and len(pages) == 13
    for s in table.values():
        assert [m["docname"] for m in s["mentions"]] == [p for p in pages if p in {m["docname"] for m in s["mentions"]}]
        assert all(m["all"] >= m["prose"] for m in s["mentions"])


def test_what_counts_as_naming_a_setting():
    names = settings_sheet.names_in
    assert names("`loss.clip_eps_high`")["loss.clip_eps"] == 0
    assert names('`kl.coef = 0.1`, PPOConfig(**{"kl.coef": 0.1}), config.kl.coef, --kl.coef')["kl.coef"] == 4
    assert names("--optim.early-stop-kl 0.2")["optim.early_stop_kl"] == 1
    assert names("the kl.coef of a run")["kl.coef"] == 0  # not marked as a name
    page = "text `kl.coef`\n```{code-cell} ipython3\ncfg = {'kl.coef': 0.1}\n```\n````{exercise}\n`kl.target`\n````\n"
    prose = settings_sheet.prose(page)
    assert "kl.target" in prose and "`kl.coef`" in prose and "cfg =" not in prose
