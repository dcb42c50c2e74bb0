"""Every relative link of the README and the docs pages leads somewhere: the file exists, and an
``#anchor`` names a heading of the page it points to (GitHub's slugs), so moving text between pages
cannot leave a reader at a dead link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import REPO

PAGES = sorted([REPO / "README.md", REPO / "tests" / "README.md", REPO / "benchmarks" / "README.md",
                *(REPO / "docs").glob("*.md")])
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """``text`` without fenced blocks (their lines are code, not links or headings)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.replace("`", "").lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(prose(page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(CODE_SPAN.sub("", prose(page.read_text())))
            if not re.match(r"[a-z]+:", target)]  # http(s), mailto: not ours to check


def test_slugs_are_githubs():
    assert slug("Save/load throughput (issue 2)") == "saveload-throughput-issue-2"
    assert slug("The seed's 70B run: TP 4 x PP 4 x DP 4") == "the-seeds-70b-run-tp-4-x-pp-4-x-dp-4"
    assert slug("`ckpt.save` and `ckpt.load`") == "ckptsave-and-ckptload"
    assert slug("Load planning (bench_planning.py)") == "load-planning-bench_planningpy"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading #{anchor}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_ci_runs_exactly_the_readmes_test_command():
    """.ci/run's command is the README's second command (the tests), character for character."""
    readme = (REPO / "README.md").read_text()
    documented = [line for line in readme.splitlines() if line.startswith("bash scripts/setup.sh && ")]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("bash scripts/setup.sh")]
    assert len(documented) == 2 and len(ci) == 1
    assert ci[0] == documented[1] and "pytest" in ci[0]
