"""RESULTS.md and the README's results block, rebuilt from the stored benchmark results.

Layout of RESULTS.md: how it was made (the runner's command, this machine, versions, the code), a
table of every goal a benchmark states with what it measured (met / missed / not measured), the
plots, then each benchmark's own section (its tables, what each row means, its machine, load, date
and exact command) under a line saying in which mode and when it ran. Nothing in it is typed by
hand: a figure quoted anywhere else (README, docs) must come from here. The README's block between
``<!-- bench:begin -->`` and ``<!-- bench:end -->`` is the goals table and the plots.
"""

from __future__ import annotations

import re
from pathlib import Path

import harness
import plots

README_BEGIN = "<!-- bench:begin (written by benchmarks/run.py; do not edit) -->"
README_END = "<!-- bench:end -->"
SYMBOL = {"<=": "≤", ">=": "≥"}


def _number(x) -> str:
    if x is None:
        return "—"
    x = float(x)
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _verdict(met) -> str:
    return "not measured" if met is None else ("**met**" if met else "**not met**")


def goals_table(records: dict, benches, link_prefix: str = "") -> list[str]:
    rows = ["| Goal | Benchmark | Measured | Target | Result | Detail |", "|---|---|---:|---:|---|---|"]
    for bench in benches:
        record = records.get(bench.name)
        if record is None:
            continue
        anchor = f"{link_prefix}#{_anchor(_heading(record, bench))}"
        where = f"[{bench.name}]({anchor}) ({record.get('mode', '?')}, {record.get('date', '?')})"
        if record.get("failed"):
            rows.append(f"| every goal of this benchmark | {where} | — | — | **failed to run** | "
                        f"{record['failed']} |")
            continue
        for g in record.get("goals", []):
            detail = str(g.get("detail", "")).replace("|", "/").replace("\n", " ")
            rows.append(f"| {g['goal']} | {where} | {_number(g.get('measured'))} | {SYMBOL.get(g.get('direction'), '')} "
                        f"{_number(g.get('target'))} | {_verdict(g.get('met'))} | {detail} |")
    return rows


def _heading(record: dict, bench) -> str:
    if record.get("failed"):
        return f"{bench.title} ({bench.script}) — failed in the latest run"
    section = record.get("section") or ""
    first = section.split("\n", 1)[0]
    return first[3:].strip() if first.startswith("## ") else f"{bench.title} ({bench.script})"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.lower())
    return text.replace(" ", "-")


JSON_OPTION = re.compile(r" --json(?:=| )\S+")


def section_of(record: dict | None, bench) -> list[str]:
    if record is None:
        return [f"## {bench.title} ({bench.script})", "",
                f"Not run yet: `python benchmarks/run.py --only {bench.name}`.", ""]
    ran = (f"*{record.get('mode', '?')} run, {record.get('date', '?')}, "
           f"{record.get('wall_s', '?')} s — `python benchmarks/run.py{' --quick' if record.get('mode') == 'quick' else ''}"
           f" --only {bench.name}`*")
    if record.get("failed"):
        return [f"## {bench.title} ({bench.script}) — failed in the latest run", "", ran, "",
                f"`{record.get('command', '')}`: {record['failed']}. Last lines of its output:", "", "```",
                *record.get("tail", []), "```", ""]
    # results stored before harness.command_line left the runner's --json out still name it
    section = JSON_OPTION.sub("", record.get("section") or "").rstrip("\n").split("\n")
    return [section[0], "", ran, *section[1:], ""]


def build(records: dict, benches, run_info: dict, out: Path, plots_dir: Path, readme: Path | None) -> None:
    drawn = plots.make_all(records, plots_dir)
    rel_plots = Path("plots") if plots_dir.parent == out.parent else plots_dir
    machine = harness.machine_description(out.parent)
    ran = ", ".join(run_info["ran"]) or "none (report rebuilt from stored results)"
    lines = [
        "# Benchmark results", "",
        "Written by `benchmarks/run.py` from the stored results in `benchmarks/results/` — do not edit by hand;",
        "rerun the benchmarks instead. Each section below says in which mode (quick: small states, one repeat;",
        "full: larger states, more repeats) and when it ran; ratios are medians with the min–max over repeats,",
        "every peer measured in the same run on the same machine.", "",
        f"Last runner call: `{run_info['command']}` on {run_info['date']} — ran {ran} in "
        f"{run_info['wall_s']:.0f} s; code {harness.git_state()}.", "",
        "Machine of the last call:", *[f"- {line}" for line in machine], "",
        "## Goals", "",
        "Every goal a benchmark states, with what its latest run measured (ratios are × the named baseline).", "",
        *goals_table(records, benches), "",
    ]
    if drawn:
        lines += ["## Plots", ""]
        for name, title in drawn:
            lines += [f"### {title}", "", f"![{title}]({rel_plots / name})", ""]
    for bench in benches:
        if bench.name in records or bench.default:
            lines += section_of(records.get(bench.name), bench)
    lines += ["## Earlier checks", "",
              "One-off before/after measurements made while refactoring the engine (issues 9 and 11) are kept in",
              "[CHECKS.md](CHECKS.md); they are not regenerated.", ""]
    out.write_text("\n".join(lines).rstrip("\n") + "\n")
    if readme is not None and readme.exists():
        update_readme(readme, records, benches, drawn, out, plots_dir)


def update_readme(readme: Path, records: dict, benches, drawn, results: Path, plots_dir: Path) -> None:
    """Replace the README's results block (when it has the markers) with the goals and the plots."""
    text = readme.read_text()
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        return
    base = results.parent.relative_to(readme.parent) if results.parent.is_relative_to(readme.parent) else results.parent
    rel_results = base / results.name
    rel_plots = plots_dir.relative_to(readme.parent) if plots_dir.is_relative_to(readme.parent) else plots_dir
    dates = sorted({r.get("date", "") for r in records.values() if r.get("date")})
    block = [README_BEGIN, "",
             f"From [{rel_results}]({rel_results}) (runs of {dates[0] if dates else '?'}"
             f"{' to ' + dates[-1] if len(dates) > 1 else ''}; modes and machines there):", "",
             *goals_table(records, benches, link_prefix=str(rel_results)), ""]
    for name, title in drawn:
        block.append(f"![{title}]({rel_plots / name})")
    block += ["", README_END]
    readme.write_text(text[:start] + "\n".join(block) + text[end + len(README_END):])
