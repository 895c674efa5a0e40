"""Every relative link in README.md and docs/*.md leads somewhere: the file exists and,
when the link names a section, the target has a heading with that anchor (GitHub's rule:
lower case, punctuation dropped, spaces to dashes). Moving a section breaks this test
rather than the reader's click."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s]+)\)")


def anchors(md: Path) -> set[str]:
    out, fenced = set(), False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def broken(doc: Path) -> list[str]:
    bad = []
    for target in LINK.findall(doc.read_text()):
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no such section")
    return bad


def test_docs_links_resolve():
    assert len(DOCS) >= 7, DOCS  # README.md and the docs/ pages
    assert {str(d.relative_to(REPO)): broken(d) for d in DOCS} == {str(d.relative_to(REPO)): [] for d in DOCS}


def test_a_broken_link_is_found(tmp_path: Path):
    (tmp_path / "a.md").write_text("# A title, here\n[ok](#a-title-here) [gone](b.md) [no](a.md#nowhere)\n")
    assert broken(tmp_path / "a.md") == ["b.md: no such file", "a.md#nowhere: no such section"]
