"""The documents the README and the code cite are in the repo: every file the README links or
names, and every "docs/design.md §N" citation resolves to a section heading of docs/design.md; the val
losses the hand-written docs quote are in the results CSVs they cite."""

import csv
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [path for pattern in ("*.md", "shardopt/**/*.py", "integrations/**/*.py", "launch/**/*.py", "launch/**/*.sh", "tests/*.py")
           for path in ROOT.glob(pattern)]


def test_every_file_the_readme_cites_exists():
    readme = (ROOT / "README.md").read_text()
    cited = set(re.findall(r"\]\(([^)#\s]+)", readme))
    # (results/ paths are what a benchmark writes, not documents: one not yet run has none)
    cited |= set(re.findall(r"`((?:docs|launch|integrations|shardopt|tests)/[\w./-]+)`", readme))
    assert {"docs/design.md", "docs/tuning.md"} <= cited
    missing = sorted(path for path in cited if not path.startswith("http") and not (ROOT / path).exists())
    assert not missing, missing


def test_every_file_the_docs_cite_exists():
    """docs/*.md: a link is relative to docs/, a `path` in backticks to the repo root."""
    missing = []
    for document in sorted((ROOT / "docs").glob("*.md")):
        text = document.read_text()
        links = {document.parent / link for link in re.findall(r"\]\(([^)#\s]+)", text) if not link.startswith("http")}
        named = {ROOT / path for path in re.findall(r"`((?:docs|launch|integrations|shardopt|tests)/[\w./-]+)`", text)}
        missing += sorted(f"{document.name}: {path.relative_to(ROOT)}" for path in links | named if not path.exists())
    assert not missing, missing


def test_the_readme_is_short_and_install_is_near_the_top():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the full tables and the history go to docs/"
    assert "## Install" in lines[:60], "the ## Install heading is not within the README's first 60 lines"


def test_the_readme_s_first_two_commands_are_the_demo_and_the_test_suite():
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    commands = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    assert [c for c in commands if c][:2] == ["bash launch/demo.sh", "bash launch/test.sh"]


def test_every_design_section_citation_resolves():
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "design.md").read_text(), re.M))
    citations = {(path.relative_to(ROOT).as_posix(), number) for path in SOURCES
                 for number in re.findall(r"docs/design\.md §(\d+)", path.read_text())}
    assert len(citations) >= 10                  # the code and tests do cite it
    unresolved = sorted(c for c in citations if c[1] not in sections)
    assert not unresolved, unresolved


def test_no_citation_of_a_design_document_outside_the_repo():
    stale = sorted(path.relative_to(ROOT).as_posix() for path in SOURCES if re.search(r"\bDESIGN(\.md)?\b", path.read_text()))
    assert not stale, stale


def _quoted_losses(text: str) -> list[str]:
    """The val losses a text quotes: numbers from 3 to 7 with three decimals."""
    return re.findall(r"(?<![\d.])([3-6]\.\d{3})(?!\d)", text)


def _recorded_losses(paths: list[str]) -> list[float]:
    """Every value of a *loss* column in the CSVs at `paths` (repo-relative)."""
    values = []
    for path in paths:
        for row in csv.DictReader((ROOT / path).open()):
            values += [float(value) for key, value in row.items() if "loss" in key and re.fullmatch(r"[\d.]+", value or "")]
    return values


def _untraced_losses(document: str, sections: tuple[str, ...]) -> tuple[list, int]:
    """The val losses quoted in `document`'s sections whose heading starts with one of `sections` that are not
    (to their three decimals) a loss recorded in a results CSV cited by their paragraph or bullet, or, where
    it cites none, by their section's opening; and how many were checked. A paragraph that says its runs
    are "not in the CSV" is the reader's to take on trust and is skipped."""
    untraced, checked = [], 0
    for section in re.split(r"\n(?=## )", (ROOT / document).read_text()):
        if not section.startswith(tuple(f"## {name}" for name in sections)):
            continue
        opening, *items = re.split(r"\n(?=- |\*\*)", section)
        for item in items:
            if "not in the CSV" in item:
                continue
            cited = re.findall(r"results/\w+\.csv", item) or re.findall(r"results/\w+\.csv", opening)
            recorded = _recorded_losses(cited)
            for quoted in _quoted_losses(item):
                checked += 1
                if not any(abs(float(quoted) - value) <= 5e-4 + 1e-9 for value in recorded):
                    untraced.append((item.split("\n")[0][:50], quoted, cited))
    return untraced, checked


@pytest.mark.parametrize("document, sections, at_least", [
    ("docs/tuning.md", ("",), 80),                                        # (93 today)
    ("docs/benchmarks.md", ("Local steps", "Model sizes"), 200)])   # (249 today)
def test_every_loss_the_docs_quote_is_in_the_csv_they_cite(document, sections, at_least):
    """docs/tuning.md and the local-steps and model-size parts of docs/benchmarks.md are typed by hand: each
    val loss they quote must trace to a CSV the paragraph (or its section) cites. A quote with no CSV fails."""
    untraced, checked = _untraced_losses(document, sections)
    assert checked >= at_least
    assert not untraced, untraced
