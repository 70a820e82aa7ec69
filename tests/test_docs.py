"""The README and docs/: every relative link resolves, and every Python block's imports import.

Links: each ``[text](target)`` outside code that is not a URL names a file or folder
that exists, and a ``#anchor`` into a Markdown file names one of its headings (GitHub's
slugs). Code: the ``import`` statements of each ```` ```python ```` block run (only those
statements, not the block); a block that is a fragment (it does not parse) has its
import lines checked one by one.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    kept = []
    for ch in text:
        if ch in " -_" or unicodedata.category(ch)[0] in "LNM":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        slug = _slug(m.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(page: Path) -> list[tuple[int, str]]:
    found = []
    for n, line in _prose_lines(page.read_text(encoding="utf-8")):
        line = INLINE_CODE.sub("", line)
        found += [(n, m.group(1)) for m in LINK.finditer(line)]
        found += [(n, m.group(1)) for m in IMAGE.finditer(line)]
    return found


def broken_links(page: Path) -> list[str]:
    """Every relative link of ``page`` that names no file, folder or heading."""
    broken = []
    for n, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{_rel(page)}:{n}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{where} (no heading #{anchor} in {dest.name})")
    return broken


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(first line, source) of each ```python block."""
    blocks, current, start = [], None, 0
    for n, line in enumerate(page.read_text(encoding="utf-8").split("\n"), 1):
        stripped = line.strip()
        if current is None and re.match(r"^```\s*python\s*$", stripped):
            current, start = [], n + 1
        elif current is not None and stripped.startswith("```"):
            blocks.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def import_statements(source: str) -> list[ast.stmt]:
    """The block's top-level import statements; for a fragment, its import lines alone."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        statements = []
        for line in source.split("\n"):
            if re.match(r"^(import\s|from\s+\S+\s+import\s)", line):
                try:
                    statements += ast.parse(line.split("#")[0]).body
                except SyntaxError:
                    continue
        return statements
    return [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]


def test_pages_exist() -> None:
    names = {p.name for p in PAGES}
    assert {"README.md", "CHANGELOG.md", "limitations.md", "budget-and-loops.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_python_blocks_import(page: Path) -> None:
    failures = []
    for line, source in python_blocks(page):
        for node in import_statements(source):
            code = compile(ast.Module(body=[node], type_ignores=[]), _rel(page), "exec")
            try:
                exec(code, {})  # noqa: S102 - the docs' own import statements
            except Exception as exc:  # noqa: BLE001 - report every failing import
                failures.append(f"{_rel(page)}:{line + node.lineno - 1}: "
                                f"{ast.unparse(node)}: {type(exc).__name__}: {exc}")
    assert failures == []


def test_checks_catch_what_they_should(tmp_path: Path) -> None:
    """The checks themselves: a missing file, a missing heading, an import that fails."""
    (tmp_path / "other.md").write_text("# A heading: `with_code`\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-heading-with_code) [ok](other.md#twice-1) [ok](#here) "
        "[web](https://example.com/x) `[code](nowhere.md)`\n\n## Here\n\n"
        "[gone](missing.md) [bad anchor](other.md#nope)\n\n"
        "```python\n[nowhere](in_code.md)\n```\n"
    )
    assert broken_links(page) == [
        "page.md:5: missing.md (no such file)",
        "page.md:5: other.md#nope (no heading #nope in other.md)",
    ]
    fragment = "import os\nfrom remat import no_such_name\nmodel(...  # a fragment\n"
    assert [ast.unparse(s) for s in import_statements(fragment)] == [
        "import os", "from remat import no_such_name"]
