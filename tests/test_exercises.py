"""Every exercise of the book has a difficulty, ★ to ★★★, as the title of its directive (an
opening line such as ````{exercise} ★★), and appendix D agrees with the pages: its count of the
exercises per page and level, and the level it prints beside each exercise of its week plan.

The pages are read as text (no build, no torch): a change of level, a new exercise or a new page
with exercises fails here until appendix D says so too."""

import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "book" / "_scripts"))
import twins  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
APPENDIX_D = ROOT / "book" / "appendix_d_instructors.md"
LEVELS = (1, 2, 3)
STAR = "★"
# an exercise's opening line, fenced with backticks or colons (MyST's colon_fence), and its title
OPENING = re.compile(r"^(?:`{3,}|:{3,})\{exercise(?:-start)?\}(?P<title>.*)$")
# the level is the title's first word: one to three stars, then the title's text if any
LEVEL = re.compile(rf"^ (?P<stars>{STAR}+)(?: +\S.*)?$")
# appendix D: a row of the count table, and an exercise of the week plan with its stars
COUNT_ROW = re.compile(r"^\| (?:\{doc\}`(?P<page>[^`]+)`|(?P<all>all)) \|(?P<counts>(?: *\d+ *\|){4})\s*$", re.M)
PLANNED = re.compile(rf"\{{ref\}}`(?P<label>[^`]+)`(?: (?P<stars>{STAR}+))?")


def exercises(page: Path) -> list[dict]:
    """Each exercise directive of a page: its line number, title argument, label and level (None
    when the title does not start with one to three stars)."""
    lines = page.read_text(encoding="utf-8").split("\n")
    found = []
    for i, line in enumerate(lines):
        opening = OPENING.match(line)
        if not opening:
            continue
        options = []
        for option in lines[i + 1 :]:
            if not option.startswith(":"):
                break
            options.append(option)
        label = next((o.split(None, 1)[1].strip() for o in options if o.startswith(":label:") and len(o.split()) > 1), None)
        level = LEVEL.match(opening["title"])
        stars = len(level["stars"]) if level else None
        found.append({"line": i + 1, "title": opening["title"].strip(), "label": label,
                      "level": stars if stars in LEVELS else None})
    return found


PAGES = {page: exercises(page) for page in twins.toc_pages()}
BY_LABEL = {e["label"]: e for found in PAGES.values() for e in found if e["label"]}


def test_every_exercise_has_a_label_and_a_level_of_one_to_three_stars():
    assert all(page.exists() for page in PAGES), [str(p) for p in PAGES if not p.exists()]
    chapters = [p for p in PAGES if p.name.startswith("ch")]
    assert chapters and all(PAGES[p] for p in chapters), [p.name for p in chapters if not PAGES[p]]  # the parser finds them
    unlabelled = [f"{p.name}:{e['line']}" for p, found in PAGES.items() for e in found if not e["label"]]
    assert not unlabelled, f"exercises without a :label: (the week plan refers to them by it): {unlabelled}"
    bad = [f"{p.name}:{e['line']} ({e['label']}): title {e['title']!r}" for p, found in PAGES.items() for e in found if e["level"] is None]
    assert not bad, (f"an exercise's title must start with its level, {STAR}, {STAR * 2} or {STAR * 3} "
                     f"(````{{exercise}} {STAR * 2} optional title; see appendix D):\n" + "\n".join(bad))
    labels = Counter(e["label"] for found in PAGES.values() for e in found)
    assert not [k for k, n in labels.items() if n > 1], [k for k, n in labels.items() if n > 1]


def test_the_form_of_a_level_is_checked():
    """The title's parser: what it accepts and what it refuses, on made-up opening lines."""
    accepted = {"````{exercise} ★": 1, "````{exercise} ★★★": 3, ":::{exercise} ★★ A title": 2}
    for line, level in accepted.items():
        stars = LEVEL.match(OPENING.match(line)["title"])["stars"]
        assert len(stars) == level, line
    for line in ("````{exercise}", "````{exercise} A title", "````{exercise} ★★A title", "````{exercise} [2]"):
        assert not LEVEL.match(OPENING.match(line)["title"]), line
    assert len(LEVEL.match(OPENING.match("````{exercise} ★★★★")["title"])["stars"]) not in LEVELS


def test_appendix_d_counts_the_exercises_of_every_page_by_level():
    text = APPENDIX_D.read_text(encoding="utf-8")
    rows = {m["page"] or "all": [int(c) for c in m["counts"].strip(" |").split("|")] for m in COUNT_ROW.finditer(text)}
    counted = {}
    for page, found in PAGES.items():
        if found:
            per_level = Counter(e["level"] for e in found)
            counted[page.stem] = [per_level[k] for k in LEVELS] + [len(found)]
    counted["all"] = [sum(c[k] for c in counted.values()) for k in range(len(LEVELS) + 1)]
    assert rows == counted, {k: (rows.get(k), counted.get(k)) for k in rows.keys() | counted.keys() if rows.get(k) != counted.get(k)}
    total = counted["all"][-1]
    assert f"{total} in all" in text, f"appendix D's prose should say there are {total} exercises in all"


def test_the_week_plan_names_real_exercises_at_their_level():
    text = APPENDIX_D.read_text(encoding="utf-8")
    planned = list(PLANNED.finditer(text))
    assert len(planned) > 20, "the week plan refers to the exercises with {ref}`label` followed by their stars"
    unknown = sorted({m["label"] for m in planned if m["label"] not in BY_LABEL})
    assert not unknown, f"appendix D refers to labels that are no exercise of a page in _toc.yml: {unknown}"
    wrong = [f"{m['label']}: {m['stars'] or 'no stars'} in appendix D, {STAR * BY_LABEL[m['label']]['level']} on its page"
             for m in planned if BY_LABEL[m["label"]]["level"] and len(m["stars"] or "") != BY_LABEL[m["label"]]["level"]]
    assert not wrong, wrong
