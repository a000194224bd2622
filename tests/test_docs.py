"""Every Python block in the docs is a doctest, so pytest runs it (see pyproject's doctest-glob)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_are_doctests(path):
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    for block in blocks:
        assert block.lstrip().startswith(">>>"), f"{path.name}: a python block is not a doctest:\n{block[:200]}"
        # a blank line must end the last output, or doctest would expect the closing fence
        assert block.endswith("\n\n"), f"{path.name}: end the block with a blank line before ```:\n{block[-200:]}"


def test_images_linked_from_docs_exist():
    for path in DOCS:
        for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", path.read_text()):
            assert (path.parent / link).is_file(), f"{path.name} links a missing image {link}"


def test_walkthrough_is_linked_from_readme():
    assert "docs/walkthrough.md" in (ROOT / "README.md").read_text()


def _anchors(path):
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated heading numbered from -1."""
    found, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_link_between_the_docs_reaches_its_file_and_heading(path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        name, _, anchor = target.partition("#")
        linked = path.parent / name if name else path
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
            broken.append(target)
    assert not broken, f"{path.name} links to what is not there: {broken}"
