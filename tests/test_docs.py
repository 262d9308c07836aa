"""The documentation's references resolve: every `design.md §N` the code cites names
docs/design.md and a section it has, nothing cites a design document outside it, and every
relative link of README.md, CHANGELOG.md and docs/*.md points to a file that exists (and, with
a ``#fragment``, to a heading of that page, as GitHub derives heading anchors)."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {".git", ".venv", "build", "runs", "__pycache__", ".pytest_cache"}
SOURCES = (".py", ".cpp", ".hpp", ".h", ".inc", ".cmake", ".txt", ".sh", ".md", ".toml", ".in")


def _sources():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith(SOURCES) or name == "run":
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    yield os.path.relpath(path, ROOT), f.read()


def test_design_citations_point_into_docs_design_md():
    with open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8") as f:
        sections = set(re.findall(r"^## (\w+)\.", f.read(), re.M))
    cited = 0
    for path, text in _sources():
        if path == os.path.join("tests", "test_docs.py"):
            continue
        assert "DESIGN.md" not in text, f"{path} cites DESIGN.md, which is not in the repository"
        for match in re.finditer(r"([\w/.]*design\.md) §(\w+)", text):
            cited += 1
            assert match.group(1) == "docs/design.md", f"{path}: {match.group(0)}"
            assert match.group(2) in sections, f"{path}: {match.group(0)}: no such section"
    assert cited > 0


PAGES = ["README.md", "CHANGELOG.md"] + sorted(
    os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page: lower case, characters other
    than letters, digits, spaces, ``-`` and ``_`` dropped, spaces made ``-``; a repeated anchor
    gets ``-1``, ``-2``, ..."""
    with open(path, encoding="utf-8") as f:
        text = _FENCE.sub("", f.read())
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def _links(page: str) -> list[str]:
    """The link targets of a page, outside code blocks and code spans."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = _CODE_SPAN.sub("", _FENCE.sub("", f.read()))
    return _LINK.findall(text)


def test_every_relative_link_of_the_pages_resolves():
    checked = 0
    for page in PAGES:
        for target in _links(page):
            if re.match(r"[a-z]+:", target):          # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path \
                else os.path.join(ROOT, page)
            assert os.path.exists(file), f"{page}: link {target!r}: no such file"
            if anchor:
                assert file.endswith(".md"), f"{page}: link {target!r}: an anchor into a non-page"
                assert anchor in _anchors(file), f"{page}: link {target!r}: no such heading"
            checked += 1
    assert checked >= 20, checked


def test_heading_anchors_are_githubs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `title`: here\n\n## Two words\n")
    assert _anchors(str(page)) == {"a-title-here", "two-words"}
