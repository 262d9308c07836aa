"""The design notes the code cites are in the repository: every `design.md §N` names
docs/design.md and a section it has, and nothing cites a design document outside it."""

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
