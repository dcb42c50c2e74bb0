"""Figures a doc quotes from a command's output are the figures the command prints now.

Each :class:`Quoted` names a doc, the ```bash command in it whose output it quotes (found by a few
words of the command) and pairs of patterns: one finds the figure in the doc's prose, the other the
same figure in what the command prints. The command is run as the doc writes it (in this process:
the trainer's ``main`` with the doc's arguments), and each pair must give the same text, so a change
of the program that moves a quoted figure fails here until the doc says the new one.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

import pytest

from tests.support import REPO
from tests.tools.test_docs_run import commands
from trainer.train import main as train_main

NUMBER = r"([\d][\d,.]*\d)"


@dataclass(frozen=True)
class Quoted:
    doc: str
    command_has: tuple[str, ...]  # words that pick the command out of the doc's bash blocks
    figures: tuple[tuple[str, str], ...]  # (pattern in the doc's prose, pattern in the output)


QUOTED = [
    Quoted("docs/LAUNCHING.md", ("seed_70b.yaml", "--dry-run"), (
        (rf"prints a peak of {NUMBER} GiB per rank", rf"fullest rank: stage \d+, {NUMBER} GiB\)"),
        (rf"with {NUMBER} GiB to spare", rf": fits, {NUMBER} GiB to spare"),
        (rf"sequence length of {NUMBER} tokens", rf"; seq_len {NUMBER}\n"),
        (rf"a full checkpoint of {NUMBER} GB", rf"\bfull {NUMBER} GB;"),
        (rf"\({NUMBER} parameters x 12 bytes", rf"^Model\s+{NUMBER} parameters"),
        (rf"up to {NUMBER} GB per rank", rf"per rank up to {NUMBER} GB"),
        (rf"and {NUMBER} GB of host memory per rank", rf"double-buffered staging: {NUMBER} GB per rank"),
    )),
]


def documented_command(quoted: Quoted) -> list[str]:
    """The arguments after ``-m trainer.train`` of the one command of the doc that has every word."""
    found = [c for c in commands((REPO / quoted.doc).read_text()) if all(w in c for w in quoted.command_has)]
    assert len(found) == 1, f"{quoted.doc}: {len(found)} commands with {quoted.command_has}: {found}"
    words = shlex.split(found[0])
    return words[words.index("trainer.train") + 1:]


@pytest.mark.parametrize("quoted", QUOTED, ids=lambda q: f"{q.doc}:{q.command_has[0]}")
def test_quoted_figures_are_what_the_command_prints(quoted, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the doc's commands run from the repository root
    assert train_main(documented_command(quoted)) == 0
    printed = capsys.readouterr().out
    prose = " ".join((REPO / quoted.doc).read_text().split())
    for in_doc, in_output in quoted.figures:
        said = re.search(in_doc, prose)
        assert said, f"{quoted.doc} no longer says /{in_doc}/"
        measured = re.search(in_output, printed, re.M)
        assert measured, f"the command no longer prints /{in_output}/:\n{printed}"
        assert said[1] == measured[1], f"{quoted.doc} quotes {said[0]!r}; the command prints {measured[0]!r}"
