"""Every in-page and cross-page anchor link of README.md and docs/*.md resolves: a link
``](#anchor)`` or ``](page.md#anchor)`` names a heading of that page, by GitHub's slugs
(lower case, punctuation dropped, spaces as ``-``, a repeated heading ``-1``, ``-2``, ...), or an
explicit ``<a id=...>``/``<a name=...>``. Headings inside fenced code blocks are no headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"\]\(([^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+\"[^\"]*\")?\)")
_EXPLICIT = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=[\"']([^\"']+)[\"']", re.IGNORECASE)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: markdown links and images as their text, inline
    HTML tags and emphasis marks dropped, lower case, every character but letters, digits,
    ``_``, ``-`` and spaces dropped, spaces as ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor ``page`` defines (headings outside code fences, explicit HTML anchors)."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    fence: str | None = None
    for line in page.read_text(encoding="utf-8").splitlines():
        opened = _FENCE.match(line)
        if opened:
            marker = opened.group(1)
            if fence is None:
                fence = marker[0] * 3
            elif marker.startswith(fence):
                fence = None
            continue
        if fence is not None:
            continue
        found.update(_EXPLICIT.findall(line))
        heading = _HEADING.match(line)
        if heading:
            base = slug(heading.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every link with a ``#`` in ``page`` outside code fences and
    inline code."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        opened = _FENCE.match(line)
        if opened:
            marker = opened.group(1)
            if fence is None:
                fence = marker[0] * 3
            elif marker.startswith(fence):
                fence = None
            continue
        if fence is not None:
            continue
        prose = re.sub(r"`[^`]*`", "", line)
        out += [(number, target) for target in _LINK.findall(prose) if "#" in target]
    return out


def broken(page: Path) -> list[str]:
    """``page:line: target (why)`` for every anchor link of ``page`` that resolves to nothing."""
    problems = []
    for number, target in links(page):
        path, _, anchor = target.partition("#")
        if re.match(r"^[a-z][a-z0-9+.-]*:", path):  # http:, https:, mailto:: not ours to check
            continue
        linked = page if not path else (page.parent / path).resolve()
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if linked.suffix != ".md":
            continue
        if not linked.is_file():
            problems.append(f"{where} (no such page)")
        elif anchor not in anchors(linked):
            problems.append(f"{where} (no such heading in {linked.name})")
    return problems


def test_slugs_follow_github() -> None:
    assert slug("`debugger.save(variable, name, save_backward=True)` (also `PrecisionDebugger.save(...)`)") == (
        "debuggersavevariable-name-save_backwardtrue-also-precisiondebuggersave"
    )
    assert slug("What cc sees under DDP and FSDP") == "what-cc-sees-under-ddp-and-fsdp"
    assert slug("`monitors.cc`") == "monitorscc"
    assert slug("Re-using an output folder") == "re-using-an-output-folder"
    assert slug("A [link](x.md) and <b>bold</b>") == "a-link-and-bold"


def test_repeated_headings_and_fences(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text('# Top\n## Part\n```bash\n# not a heading\n```\n## Part\n<a id="here"></a>\n', encoding="utf-8")
    assert anchors(page) == {"top", "part", "part-1", "here"}
    page.write_text("[a](#top) [b](#part-1) [c](#nowhere) `[d](#code)`\n# Top\n## Part\n## Part\n", encoding="utf-8")
    assert [t for _, t in links(page)] == ["#top", "#part-1", "#nowhere"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_anchor_link_resolves(page: Path) -> None:
    assert broken(page) == []
