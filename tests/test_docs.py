"""The documentation against the code: page sizes, links, the README's strategy table against the
registry, and the worked example of docs/adding-a-strategy.md against strategies/keep_it_odd.py."""

import re
from pathlib import Path

import pytest

import strategies

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARK = ROOT / "BENCHMARK.md"
ADDING_A_STRATEGY = ROOT / "docs" / "adding-a-strategy.md"
EXAMPLE = ROOT / "strategies" / "keep_it_odd.py"
MAX_PAGE_BYTES = 12 * 1024
PAGES = [README, BENCHMARK, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("page", [README, BENCHMARK], ids=lambda p: p.name)
def test_front_pages_stay_under_12_kb(page):
    size = page.stat().st_size
    assert size < MAX_PAGE_BYTES, f"{page.name} is {size} bytes; move reference material to docs/"


def test_benchmark_has_no_commit_hashes():
    # A word of 7 to 40 hex digits with both a digit and a letter reads as a commit: git keeps the history.
    hashes = [
        w for w in re.findall(r"\b[0-9a-f]{7,40}\b", read(BENCHMARK)) if re.search(r"\d", w) and re.search(r"[a-f]", w)
    ]
    assert not hashes, f"BENCHMARK.md names commits: {hashes}"


def test_every_docs_link_in_the_readme_points_to_a_file():
    targets = [t.split("#")[0] for t in LINK.findall(read(README)) if t.startswith("docs/")]
    assert targets, "the README links no docs/ page"
    missing = sorted({t for t in targets if not (ROOT / t).is_file()})
    assert not missing, f"README links to missing pages: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", read(path), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_files_and_headings(page):
    for target in LINK.findall(read(page)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.exists(), f"{page.name} links to missing {target}"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{page.name} links to missing heading {target}"


def table_after(text: str, heading: str) -> list[list[str]]:
    """The rows (cells) of the first markdown table after `heading`, header and rule left out."""
    section = text.split(heading, 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def test_readme_strategy_table_lists_the_registry():
    rows = table_after(read(README), "\n## Strategies\n")
    names = [row[0].strip("`") for row in rows]
    assert names == list(strategies.STRATEGIES), "README's strategy table must list STRATEGIES, in order"


def example_block(text: str, path: str) -> str:
    """The ```python block whose preceding non-blank line names `path`."""
    for match in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.M | re.S):
        before = [line for line in text[: match.start()].splitlines() if line.strip()]
        if before and path in before[-1]:
            return match.group(1)
    raise AssertionError(f"no ```python block right after a line naming {path}")


def test_adding_a_strategy_shows_keep_it_odd_as_it_is():
    block = example_block(read(ADDING_A_STRATEGY), "strategies/keep_it_odd.py")
    assert block == read(EXAMPLE), (
        "docs/adding-a-strategy.md shows an outdated strategies/keep_it_odd.py: paste the file's text into its block"
    )
