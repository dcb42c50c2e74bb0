"""Everything a benchmark reports: its results section, its JSON record, and the report built from them.

1. A benchmark's section (markdown; ``## <title>`` first): cells and spans (``median_span``,
   ``ratio_span``, ``ms_span``), table heads (``table_head``), goal lines (``verdict``, ``goal_line``),
   the closing ``provenance`` lines (machine, other load, date, the command of ``command_line``), and
   ``publish`` / ``write_section`` (print it; add or replace it in a results file with ``--out``).
2. The JSON record each ``bench_*.py`` writes with ``--json`` for ``run.py`` (the contract between
   them): ``metric`` (one quantity of one system: median with min-max over repeats), ``goal`` (a
   stated goal with what was measured) and ``write_json`` (the section plus those numbers and the
   plots' series).
3. RESULTS.md and the README's results block, rebuilt by ``run.py`` from the stored records (``build``).
   Layout of RESULTS.md: how it was made (the runner's command, this machine, versions, the code), a
   table of every goal a benchmark states with what it measured (met / missed / not measured), the
   plots, then each benchmark's own section (its tables, what each row means, its machine, load,
   date and exact command) under a line saying in which mode and when it ran. Nothing in it is typed
   by hand: a figure quoted anywhere else (README, docs) must come from here. The README's block
   between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` is the goals table and the plots.
   The plots module (matplotlib) is imported by ``build`` only, so a benchmark needs no plotting
   library to report.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Sequence

import harness
from harness import REPO, median


# ---------------------------------------------------------------------------------------------
# 1. A benchmark's section
# ---------------------------------------------------------------------------------------------
def median_span(xs: Sequence[float], digits: int = 3) -> str:
    """'median (min–max)', as the tables print a set of repeats."""
    return f"{median(xs):.{digits}f} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


def ratio_span(xs: Sequence[float], unit: str = "") -> str:
    """'median<unit>' for one repeat, 'median<unit> (min–max)' for several."""
    return f"{median(xs):.2f}{unit}" + (f" ({min(xs):.2f}–{max(xs):.2f})" if len(xs) > 1 else "")


def ms_span(seconds: Sequence[float]) -> str:
    """Seconds shown as 'median (min–max)' milliseconds, one decimal; '–' when there are none."""
    if not seconds:
        return "–"
    return f"{median(seconds) * 1e3:.1f} ({min(seconds) * 1e3:.1f}–{max(seconds) * 1e3:.1f})"


def table_head(columns: Sequence[str], align: str) -> list[str]:
    """A markdown table's head row and rule: ``align`` has one letter per column, ``l`` (text) or
    ``r`` (numbers)."""
    if len(align) != len(columns) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r} does not fit {len(columns)} columns")
    return ["| " + " | ".join(columns) + " |", "|" + "".join("---|" if a == "l" else "---:|" for a in align)]


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


def goal_line(g: dict, digits: int = 3) -> str:
    """'- Goal, <goal>: **met** (measured 0.031; <detail>).' — how a section states one ``goal``."""
    shown = "" if g["measured"] is None else f"measured {g['measured']:.{digits}f}; "
    return f"- Goal, {g['goal']}: {verdict(g['met'])} ({shown}{g['detail']})."


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that reproduces this run, as it goes into the report (``--json FILE``, where the
    runner keeps the numbers, is an output and left out)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--json" in args:
        at = args.index("--json")
        del args[at:at + 2]
    args = [a for a in args if not a.startswith("--json=")]
    return "python " + shlex.join([os.path.relpath(sys.argv[0], REPO) if argv is None else f"benchmarks/{script}",
                                   *args])


def provenance(machine: list[str], command: str, load: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The closing lines of every results section: the machine, the other load on it during the run
    (``Load.describe()``), ``extra`` lines, the date, then the command."""
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = [*machine, *([f"Other load on the machine: {load}"] if load is not None else []), *extra, f"Date: {date}"]
    return ["Machine:", *[f"- {line}" for line in lines], "", "Command:", "", "```", command, "```", ""]


def publish(section: str, out: str | None) -> None:
    """Print the section and, with ``--out``, add or replace it in the results file."""
    print()
    print(section)
    if out:
        write_section(Path(out), section)
        print(f"wrote section to {out}")


def write_section(out: Path, section: str) -> None:
    """Add or replace ``section`` (its first line is its ``## `` heading) in the results file,
    re-read right before writing so other benchmarks' sections are kept."""
    heading = section.split("\n", 1)[0]
    text = out.read_text() if out.exists() else "# Benchmark results\n\n"
    start = text.find(heading)
    if start < 0:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(heading))
        tail = text[end + 1 :] if end >= 0 else ""
        new = text[:start] + section + ("\n" + tail if tail else "")
    out.write_text(new.rstrip("\n") + "\n")


# ---------------------------------------------------------------------------------------------
# 2. The JSON record (the contract between every bench_*.py and run.py)
# ---------------------------------------------------------------------------------------------
def metric(system: str, name: str, unit: str, values: Sequence[float], x: float | None = None,
           **extra) -> dict:
    """One measured quantity of one system: median with min-max over ``values`` (one per repeat).
    ``name`` is a stable key (``save_s``, ``stall_s``, ``peak_mib``, ``tokens_per_s`` ...); ``x`` is
    the scaling variable of a curve (state bytes, ranks) when the metric is one point of one."""
    vals = [float(v) for v in values]
    return {"system": system, "metric": name, "unit": unit, "median": median(vals) if vals else None,
            "min": min(vals) if vals else None, "max": max(vals) if vals else None, "n": len(vals),
            **({"x": x} if x is not None else {}), **extra}


def goal(name: str, measured: float | None, target: float, direction: str, detail: str = "") -> dict:
    """A goal the report states, with what the run measured: ``direction`` is ``">="`` or ``"<="``
    (``measured`` against ``target``); ``met`` is None when the run could not measure it."""
    met = None if measured is None else (measured >= target if direction == ">=" else measured <= target)
    return {"goal": name, "measured": measured, "target": target, "direction": direction, "met": met,
            "detail": detail}


def write_json(path: str | None, bench: str, section: str, command: str, *, metrics: Sequence[dict] = (),
               goals: Sequence[dict] = (), series: dict | None = None, params: dict | None = None) -> None:
    """With ``--json PATH``: the section's markdown and its numbers in one file for ``run.py``.

    ``series`` holds the data of the plots that are not a metric per system (e.g. the delta ratio per
    save over a training run: ``{"delta_ratio": {"ours": [[step, ratio], ...], ...}}``)."""
    if not path:
        return
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    record = {"bench": bench, "date": date, "command": command, "params": params or {},
              "metrics": list(metrics), "goals": list(goals), "series": series or {}, "section": section}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1, default=str) + "\n")


# ---------------------------------------------------------------------------------------------
# 3. RESULTS.md and the README's block, from the stored records
# ---------------------------------------------------------------------------------------------
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


def last_call_lines(report: Path) -> list[str] | None:
    """An existing report's "Last runner call" line and machine lines (what --report-only keeps)."""
    lines = report.read_text().splitlines() if report.exists() else []
    start = next((i for i, line in enumerate(lines) if line.startswith("Last runner call:")), None)
    end = next((i for i, line in enumerate(lines) if line == "## Goals"), None)
    return None if start is None or end is None or end < start else lines[start:end]


def build(records: dict, benches, run_info: dict, out: Path, plots_dir: Path, readme: Path | None) -> None:
    import plots  # matplotlib: only the runner's report draws

    drawn = plots.make_all(records, plots_dir)
    rel_plots = Path("plots") if plots_dir.parent == out.parent else plots_dir
    ran = ", ".join(run_info["ran"]) or "none (report rebuilt from stored results)"
    last_call = run_info.get("previous") or [
        f"Last runner call: `{run_info['command']}` on {run_info['date']} — ran {ran} in "
        f"{run_info['wall_s']:.0f} s; code {harness.git_state()}.", "",
        "Machine of the last call:", *[f"- {line}" for line in harness.machine_description(out.parent)], ""]
    lines = [
        "# Benchmark results", "",
        "Written by `benchmarks/run.py` from the stored results in `benchmarks/results/` — do not edit by hand;",
        "rerun the benchmarks instead. Each section below says in which mode (quick: small states, one repeat;",
        "full: larger states, more repeats) and when it ran; ratios are medians with the min–max over repeats,",
        "every peer measured in the same run on the same machine.", "",
        *last_call,
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
    text = "\n".join(lines).rstrip("\n") + "\n"
    if not out.exists() or out.read_text() != text:  # unchanged figures: the file (and its date) stay
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
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
