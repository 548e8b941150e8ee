"""Cut the web font that renders the book's Chinese terms on any system, offline.

The glossary and a few chapters give each term's Chinese equivalent. A browser without a CJK font
(a minimal Linux, a headless browser) draws them as empty boxes, so the book ships its own: Noto
Sans CJK SC (SIL Open Font License 1.1), cut down to the glyphs the book uses, as WOFF2, in
`_static/`, where Jupyter Book serves it and `_static/cjk.css` declares it.

    python book/_scripts/cjk_font.py FONT     regenerate _static/noto-sans-sc-subset.woff2
    python book/_scripts/cjk_font.py --list   print the characters the font must hold

FONT is a Noto Sans CJK file: an .otf of the SC face, or a .ttc collection holding it (for
example the one in the PyPI package manimgx-fonts-cjk). A variable font is fixed at weight 400
first. Needs fonttools with brotli (`pip install "fonttools[woff]"`). A test
(`tests/test_book.py`) fails, naming the characters, when a page uses one the font lacks.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "_static" / "noto-sans-sc-subset.woff2"
# CJK punctuation, ideographs (with extension A) and full-width forms: what the system's Latin
# fonts lack. The CSS's unicode-range matches these blocks.
CJK = re.compile(r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]")


def characters() -> str:
    """Every CJK character of the book's pages (book/*.md), sorted, each once."""
    found = set()
    for page in sorted((ROOT / "book").glob("*.md")):
        found |= set(CJK.findall(page.read_text(encoding="utf-8")))
    return "".join(sorted(found))


def cut(font_path: str, out: Path = OUT) -> Path:
    from fontTools import subset
    from fontTools.ttLib import TTCollection, TTFont
    from fontTools.varLib import instancer

    if font_path.lower().endswith((".ttc", ".otc")):
        faces = [f for f in TTCollection(font_path).fonts if f["name"].getDebugName(1).endswith(" SC")]
        if not faces:
            raise SystemExit(f"{font_path}: no Simplified Chinese (SC) face in this collection")
        font = faces[0]
    else:
        font = TTFont(font_path)
    if "fvar" in font:
        font = instancer.instantiateVariableFont(font, {"wght": 400})
    options = subset.Options()
    options.flavor = "woff2"
    options.name_IDs = ["*"]  # keep the copyright and licence records (name IDs 0, 13, 14)
    options.layout_features = ["*"]
    subsetter = subset.Subsetter(options)
    subsetter.populate(text=characters())
    subsetter.subset(font)
    out.parent.mkdir(parents=True, exist_ok=True)
    font.flavor = "woff2"
    font.save(str(out))
    return out


def main(argv: list[str]) -> int:
    if argv == ["--list"]:
        print(characters())
        return 0
    if len(argv) != 1:
        print(__doc__)
        return 2
    out = cut(argv[0])
    print(f"{out.relative_to(ROOT)}: {len(characters())} characters, {out.stat().st_size / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
