"""The README stays a front door, and the docs' relative links point at files that exist."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250
MAX_LINE_CHARS = 400

# [text](target) and ![alt](target), target up to the first space or ")"; reference-style
# definitions ("[name]: target") too. Code spans and fenced blocks are removed first.
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(text: str) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines, more than {MAX_README_LINES}: it is the front door (what Orchard is, "
        "the quick start, the tested walkthrough, links); move reference material into a page under docs/")


def test_readme_lines_are_short() -> None:
    long = [(i, len(line)) for i, line in enumerate(README.read_text().splitlines(), 1) if len(line) > MAX_LINE_CHARS]
    assert not long, (f"README.md lines over {MAX_LINE_CHARS} characters (line, length): {long}; "
                      "a figure's history belongs in benchmarks/results/, not in a table cell")


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(page: Path) -> None:
    missing = []
    for target in relative_links(page.read_text()):
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if path and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_link_finder_sees_links_and_skips_code() -> None:
    text = ("See [ops](docs/operating.md#rounds) and ![shot](dashboard.png), [web](https://example.com), "
            "[here](#quick-start), `[not](a-link.md)`.\n\n[ref]: docs/async.md\n\n```\n[no](inside.md)\n```\n")
    assert relative_links(text) == ["docs/operating.md#rounds", "dashboard.png", "docs/async.md"]
