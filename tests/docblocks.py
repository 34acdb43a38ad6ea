"""The code blocks of a document, by heading, so a test runs exactly what the docs show a user."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(document: str, heading: str) -> list[str]:
    """The ```python blocks under the Markdown heading `heading` (any level, exact text) of
    `document` (a path relative to the repo root), up to the next heading of the same or a higher
    level. Raises if the heading or its blocks are missing, so a renamed section fails its test."""
    text = (ROOT / document).read_text()
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    if match is None:
        raise AssertionError(f"{document} has no heading {heading!r}")
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    section = rest[:end.start()] if end else rest
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.M | re.S)
    if not blocks:
        raise AssertionError(f"{document}, section {heading!r}, has no ```python block")
    return blocks


def python_block(document: str, heading: str) -> str:
    """The single ```python block under `heading` (see python_blocks)."""
    blocks = python_blocks(document, heading)
    if len(blocks) != 1:
        raise AssertionError(f"{document}, section {heading!r}, has {len(blocks)} python blocks, expected 1")
    return blocks[0]
