"""Every relative link of the Markdown documents reaches a file, and its anchor a heading.

The README sends a newcomer to benchmarks/README.md, tests/README.md and docs/*.md sections by
anchor (#39); a renamed heading or a moved file would leave the link dead without a word.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = (
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    ROOT / "tests" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
)
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
_FENCE = re.compile(r"^(`{3,}|~{3,})")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text (outside fenced blocks).

    Lower case; every character but letters, digits, ``_``, ``-`` and spaces dropped; spaces
    become ``-`` (a repeated heading's ``-1`` suffix is not modelled: no document repeats one).
    """
    found, fence = set(), ""
    for line in text.splitlines():
        opening = _FENCE.match(line)
        if opening and (not fence or opening[1].startswith(fence)):
            fence = "" if fence else opening[1]
            continue
        if not fence and line.startswith("#"):
            heading = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return found


def dead_links(path: Path, root: Path = ROOT) -> list[str]:
    """``doc: link (why)`` for each relative link of ``path`` that leads nowhere, the paths
    named relative to ``root``."""
    text = path.read_text()
    dead = []
    for match in _LINK.finditer(text):
        target = match["target"]
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        name, _, anchor = target.partition("#")
        goal = (path.parent / name).resolve() if name else path
        where = f"{path.relative_to(root)}: {target}"
        if not goal.exists():
            dead.append(f"{where} (no such file)")
        elif anchor and goal.suffix == ".md" and anchor not in anchors(goal.read_text()):
            dead.append(f"{where} (no heading with that anchor in {goal.relative_to(root)})")
    return dead


def test_anchors_are_githubs_slugs_of_the_headings_outside_code() -> None:
    text = "# tfscale\n## 1. Use every device: `model.fit`\n```sh\n# not a heading\n```\n"
    assert anchors(text) == {"tfscale", "1-use-every-device-modelfit"}


def test_a_link_to_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n## Its part\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Here\n[a](#here) [b](#gone) [c](other.md#its-part) [d](other.md#no-part)\n"
        "[e](nothing.md) [f](https://example.com/x#y)\n"
    )
    assert dead_links(doc, tmp_path) == [
        "doc.md: #gone (no heading with that anchor in doc.md)",
        "doc.md: other.md#no-part (no heading with that anchor in other.md)",
        "doc.md: nothing.md (no such file)",
    ]


def test_every_relative_link_of_the_docs_leads_somewhere() -> None:
    dead = [line for path in DOCS for line in dead_links(path)]
    assert not dead, "dead links (fix the link or the heading):\n" + "\n".join(dead)
