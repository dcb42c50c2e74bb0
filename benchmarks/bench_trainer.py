#!/usr/bin/env python
"""Trainer throughput: checkpointing cost and framework overhead, in one run (issue 4).

    python benchmarks/bench_trainer.py --out benchmarks/RESULTS.md

Single process on CPU, ``torch.set_num_threads(--threads)`` set explicitly. For each model flavor
(``--flavors``, default ``debug`` and ``small``) these variants run, interleaved: every repeat runs
each variant once, in an order rotated per repeat, and the table shows the median over repeats.

trainer fsdp2            ``Trainer(load_config(argv))`` with ``--config configs/debug.toml`` and
                         ``--checkpoint.enable false``: FSDP2 (``zero_stage 3``, the config's) over
                         the 1-rank gloo group the trainer starts itself.
trainer fsdp2 + ckpt     the same with ``--checkpoint.enable true --checkpoint.interval 10
                         --checkpoint.async_mode double_buffer`` (a save every 10 steps, async).
trainer ddp              ``--optimization.zero_stage 0``: DDP over the same 1-rank group.
trainer fsdp2 zero2      (optional) ``--optimization.zero_stage 2``: FSDP2 without resharding.
trainer ddp + ckpt       (optional) DDP with the checkpointing of ``trainer fsdp2 + ckpt``.
minimal loop             the same model (``trainer.model.build`` with the same args and seed), the
                         same data (``trainer.data.DataLoader``, same seed, batch, seq_len), AdamW
                         with the trainer's hyper-parameters and LR schedule, and per step:
                         ``model(inputs)``, ``F.cross_entropy``, ``backward``,
                         ``clip_grad_norm_`` (defaults), ``step``, ``scheduler.step``,
                         ``zero_grad(set_to_none=True)``, ``loss.item()``. No process group, no
                         wrapper.

What is timed: the wall time (``time.perf_counter``) at the start of every step, recorded by a thin
wrapper around ``Trainer.train_step`` (the minimal loop records the same mark). A run has
``--warmup`` steps (excluded), then a **window** of ``--window`` steps, then one final step.
tokens/s = window steps x batch_size x seq_len / (start of the final step - start of the first
window step). The window thus contains everything the loop does per step: compute, ``save()``
calls, the optimizer-step wait for a snapshot, the loss all-reduce, bookkeeping. ``--warmup`` and
``--window`` must be multiples of the checkpoint interval (10), so the window holds exactly
``window / 10`` saves, and the background write of the save at the end of the warm-up overlaps its
start just as the write of its last save overlaps the final step. The final step (``step ==
training.steps``) force-saves and ``close()`` waits for all writes; that tail (the final step plus
``close()``) is reported separately, as it is a once-per-run cost, not steady-state throughput.

Checks: the per-step losses of ``trainer ddp`` and ``minimal loop`` are compared (same init, data
and hyper-parameters: they should agree to float rounding), as are those of ``trainer fsdp2`` with
and without checkpointing (the save must not change training).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_save_load import cpu_model, filesystem_of, meminfo, pressure_totals  # noqa: E402
from trainer import data as data_mod  # noqa: E402
from trainer import model as model_mod  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.train import Trainer, lr_lambda  # noqa: E402

SECTION = "## Trainer throughput (issue 4)"
BASE_CONFIG = "configs/debug.toml"
INTERVAL = 10
GOAL_CKPT_RATIO = 0.98
GOAL_OVERHEAD = 0.05

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")


# ---------------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------------
@dataclass
class Variant:
    key: str
    name: str
    overrides: list[str] | None  # trainer CLI overrides; None: the minimal loop
    window_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)  # inside train_step, window steps
    stall_s: list[float] = field(default_factory=list)  # manager.stats.stall_s over the window
    tail_s: list[float] = field(default_factory=list)  # final step + close()
    close_s: list[float] = field(default_factory=list)  # close() alone
    saves: list[int] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)


CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", str(INTERVAL),
        "--checkpoint.async_mode", "double_buffer"]
NO_CKPT = ["--checkpoint.enable", "false"]

ALL_VARIANTS = {
    "fsdp": ("trainer fsdp2 (zero 3), no ckpt", NO_CKPT),
    "fsdp_ckpt": ("trainer fsdp2 (zero 3) + ckpt every 10", CKPT),
    "ddp": ("trainer ddp (zero 0), no ckpt", NO_CKPT + ["--optimization.zero_stage", "0"]),
    "minimal": ("minimal loop (no wrapper)", None),
    "fsdp_z2": ("trainer fsdp2 (zero 2), no ckpt", NO_CKPT + ["--optimization.zero_stage", "2"]),
    "ddp_ckpt": ("trainer ddp (zero 0) + ckpt every 10", CKPT + ["--optimization.zero_stage", "0"]),
}
DEFAULT_VARIANTS = ["fsdp", "fsdp_ckpt", "ddp", "minimal"]


def trainer_argv(flavor: str, steps: int, dump: Path, overrides: list[str]) -> list[str]:
    return ["--config", BASE_CONFIG, "--model.flavor", flavor, "--training.steps", str(steps),
            "--training.device", "cpu", "--metrics.log_freq", "1000000000", "--job.dump_folder", str(dump),
            *overrides]


def run_trainer(argv: list[str], warmup: int, window: int) -> dict:
    """One trainer run; marks[i] = wall time at the start of step i + 1."""
    cfg = load_config(argv)
    os.makedirs(cfg.job.dump_folder, exist_ok=True)
    tr = Trainer(cfg)
    marks: list[float] = []
    ends: list[float] = []
    stalls: list[float] = []
    inner = tr.train_step

    def marked_step():
        marks.append(time.perf_counter())
        stalls.append(tr.manager.stats.stall_s if tr.manager is not None else 0.0)
        out = inner()
        ends.append(time.perf_counter())
        return out

    tr.train_step = marked_step
    gc.collect()
    try:
        losses = tr.fit()
        fit_end = time.perf_counter()
    finally:
        close_start = time.perf_counter()
        tr.close()
        close_end = time.perf_counter()
    a, b = warmup, warmup + window  # window: steps a+1 .. b; step b+1 is the final one
    saves = tr.manager.stats.saves if tr.manager is not None else 0
    return {
        "window_s": marks[b] - marks[a],
        "compute_s": sum(ends[i] - marks[i] for i in range(a, b)),
        "stall_s": stalls[b] - stalls[a],
        "tail_s": close_end - marks[b],
        "close_s": close_end - close_start,
        "final_step_s": fit_end - marks[b],
        "saves": saves,
        "losses": losses,
    }


def run_minimal(flavor: str, steps: int, warmup: int, window: int, tokens) -> dict:
    """The hand-written loop with the trainer's model, data and hyper-parameters."""
    cfg = load_config(trainer_argv(flavor, steps, Path("unused"), NO_CKPT))
    t = cfg.training
    torch.manual_seed(cfg.job.seed)
    args = model_mod.model_args(
        cfg.model.flavor, vocab_size=data_mod.ByteTokenizer.vocab_size,
        max_seq_len=max(t.seq_len, model_mod.FLAVORS[cfg.model.flavor.lower()].max_seq_len))
    model = model_mod.build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t.warmup_steps, t.steps, t.min_lr_ratio))
    loader = data_mod.DataLoader(tokens, t.seq_len, t.batch_size, 0, 1, cfg.job.seed)
    marks: list[float] = []
    losses: list[float] = []
    gc.collect()
    for _ in range(steps):
        marks.append(time.perf_counter())
        inputs, labels = loader.next_batch()
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    end = time.perf_counter()
    a, b = warmup, warmup + window
    return {"window_s": marks[b] - marks[a], "compute_s": marks[b] - marks[a], "stall_s": 0.0,
            "tail_s": end - marks[b], "close_s": 0.0, "final_step_s": end - marks[b], "saves": 0,
            "losses": losses}


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
def flavor_params(flavor: str) -> int:
    args = model_mod.model_args(flavor, vocab_size=data_mod.ByteTokenizer.vocab_size)
    with torch.device("meta"):
        return model_mod.num_params(model_mod.Transformer(args))


def run_flavor(flavor: str, fargs: dict, variants: list[Variant], repeats: int, base: Path, tokens,
               untimed_warmup: bool) -> None:
    warmup, window = fargs["warmup"], fargs["window"]
    steps = warmup + window + 1
    work = Path(tempfile.mkdtemp(prefix=f"{flavor}-", dir=base))

    def one(v: Variant, tag: str) -> dict:
        if v.overrides is None:
            return run_minimal(flavor, steps, warmup, window, tokens)
        dump = work / f"{v.key}-{tag}"
        try:
            return run_trainer(trainer_argv(flavor, steps, dump, v.overrides), warmup, window)
        finally:
            shutil.rmtree(dump, ignore_errors=True)

    try:
        if untimed_warmup:  # first-call costs of every code path (process group, FSDP, staging buffers)
            for v in variants:
                t0 = time.perf_counter()
                one(v, "warmup")
                print(f"[{flavor}] untimed warm-up {v.name}: {time.perf_counter() - t0:.1f}s", flush=True)
        tokens_per_window = window * fargs["batch"] * fargs["seq_len"]
        for rep in range(repeats):
            shift = rep % len(variants)
            for v in variants[shift:] + variants[:shift]:
                r = one(v, f"r{rep}")
                v.window_s.append(r["window_s"])
                v.compute_s.append(r["compute_s"])
                v.stall_s.append(r["stall_s"])
                v.tail_s.append(r["tail_s"])
                v.close_s.append(r["close_s"])
                v.saves.append(r["saves"])
                v.losses.append(r["losses"])
                print(f"[{flavor} {rep + 1}/{repeats}] {v.name:40s} {tokens_per_window / r['window_s']:9.0f} tok/s"
                      f"  window {r['window_s']:7.2f}s  in train_step {r['compute_s']:7.2f}s"
                      f"  ckpt stall {r['stall_s'] * 1e3:7.1f}ms  final step+close {r['tail_s']:6.2f}s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def top_other_processes(limit: int = 3) -> list[str]:
    """The busiest other processes right now (by %CPU over their lifetime, from ps)."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu"], capture_output=True, text=True,
                             timeout=5).stdout.splitlines()[1:]
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out:
        pid, pcpu, cmd = line.strip().split(None, 2)
        if int(pid) == os.getpid() or float(pcpu) < 5:
            continue
        rows.append(f"{cmd[:70]} ({pcpu}% CPU)")
        if len(rows) == limit:
            break
    return rows


def git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "ckpt", "trainer"],
                               cwd=REPO, capture_output=True, text=True, timeout=5).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (f" + uncommitted changes in {', '.join(dirty)}" if dirty else "")


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs)


def max_loss_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for la, lb in zip(a, b) for x, y in zip(la, lb))


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def flavor_report(flavor: str, fargs: dict, variants: list[Variant], repeats: int) -> list[str]:
    by = {v.key: v for v in variants}
    tokens = fargs["window"] * fargs["batch"] * fargs["seq_len"]
    ref = by.get("minimal") or by.get("fsdp")
    lines = [
        f"### {flavor} ({fargs['params'] / 1e6:.2f}M parameters; fp32 weights + AdamW state "
        f"{fargs['params'] * 12 / 1e6:.0f} MB; batch {fargs['batch']} x seq_len {fargs['seq_len']} = "
        f"{fargs['batch'] * fargs['seq_len']} tokens/step; {fargs['warmup']} warm-up steps, window of "
        f"{fargs['window']} steps, 1 final step; median of {repeats})",
        "",
        "| Variant | tokens/s | × minimal | × fsdp2 no ckpt | window s (min–max) | s/step | in train_step s/step "
        "| other s/step | ckpt stall ms/save | saves in window | final step + close s (close) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for v in variants:
        w = med(v.window_s)
        c = med(v.compute_s)
        nsave = fargs["window"] // INTERVAL if "ckpt" in v.key else 0
        stall = f"{med(v.stall_s) * 1e3 / nsave:.1f}" if nsave else "–"
        rel_min = f"{med(by['minimal'].window_s) / w:.3f}" if "minimal" in by else "–"
        rel_fsdp = f"{med(by['fsdp'].window_s) / w:.3f}" if "fsdp" in by else "–"
        lines.append(
            f"| {v.name} | {tokens / w:,.0f} | {rel_min} | {rel_fsdp} "
            f"| {w:.2f} ({min(v.window_s):.2f}–{max(v.window_s):.2f}) | {w / fargs['window']:.4f} "
            f"| {c / fargs['window']:.4f} | {(w - c) / fargs['window']:.4f} | {stall} | {nsave if nsave else '–'} "
            f"| {med(v.tail_s):.2f} ({med(v.close_s):.2f}) |")
    notes = []
    if "fsdp" in by and "fsdp_ckpt" in by:
        per_rep = [a / b for a, b in zip(by["fsdp"].window_s, by["fsdp_ckpt"].window_s)]
        ratio = med(by["fsdp"].window_s) / med(by["fsdp_ckpt"].window_s)
        notes.append(
            f"- Goal tokens/s with a save every {INTERVAL} steps ≥ {GOAL_CKPT_RATIO}× without: {verdict(ratio >= GOAL_CKPT_RATIO)} "
            f"({ratio:.3f}× on medians; per repeat {', '.join(f'{x:.3f}' for x in per_rep)}). Once per run, the final "
            f"forced save + `close()` take {med(by['fsdp_ckpt'].tail_s):.2f}s vs {med(by['fsdp'].tail_s):.2f}s "
            f"for the final step without checkpointing (not in the ratio).")
        d = max_loss_diff(by["fsdp"].losses, by["fsdp_ckpt"].losses)
        notes.append(f"- Losses with and without checkpointing: max |difference| {d:.2g} over all steps and repeats.")
    if "ddp_ckpt" in by and "ddp" in by:
        ratio = med(by["ddp"].window_s) / med(by["ddp_ckpt"].window_s)
        notes.append(f"- Same ratio under DDP: {ratio:.3f}×.")
    if "minimal" in by:
        m = med(by["minimal"].window_s)
        for key in ("fsdp", "fsdp_z2", "ddp"):
            if key in by:
                over = med(by[key].window_s) / m - 1
                notes.append(f"- Goal trainer overhead ≤ {GOAL_OVERHEAD:.0%} vs the minimal loop, {by[key].name}: "
                             f"{verdict(over <= GOAL_OVERHEAD)} ({over:+.1%} time per step).")
        if "ddp" in by:
            d = max_loss_diff(by["ddp"].losses, by["minimal"].losses)
            notes.append(f"- Losses of trainer ddp and the minimal loop: max |difference| {d:.2g} (same init, data, "
                         "hyper-parameters).")
    return lines + [""] + notes + [""]


def report(results: list[tuple[str, dict, list[Variant]]], info: dict, args, command: str) -> str:
    body = [
        SECTION,
        "",
        f"Single process on CPU, `torch.set_num_threads({args.threads})`; trainer runs are `Trainer(load_config(argv))` "
        f"with `--config {BASE_CONFIG} --model.flavor F --training.steps N --training.device cpu --metrics.log_freq "
        f"1000000000 --job.dump_folder <tmp>` plus the variant's overrides (FSDP2/DDP over the 1-rank gloo group the "
        f"trainer starts); ckpt = `{' '.join(CKPT)}` (keep 3, local disk). Variants interleaved, order rotated per "
        f"repeat; medians. tokens/s over a window of steady-state steps that starts after the warm-up steps and ends "
        f"at the start of the final step, so it holds window/{INTERVAL} saves, their `save()` calls and snapshot waits, "
        f"and overlaps their background writes; the final step (forced save) + `close()` (waits for the writes) is "
        f"reported separately. 'in train_step' = forward/backward/clip/optimizer (incl. the optimizer pre-hook's "
        f"snapshot wait); 'other' = `save()`, loss all-reduce, bookkeeping. "
        f"{'An untimed warm-up run of every variant came first.' if not args.no_warmup else ''}",
        "",
    ]
    for flavor, fargs, variants in results:
        body += flavor_report(flavor, fargs, variants, args.repeats)
    body += [
        "Machine:",
        *[f"- {line}" for line in info["machine"]],
        f"- Other load on the machine: {info['contention']}",
        f"- Code: {info['git']}",
        f"- Date: {info['date']}",
        "",
        "Command:",
        "",
        "```",
        command,
        "```",
        "",
    ]
    return "\n".join(body)


def write_section(out: Path, section: str) -> None:
    text = out.read_text() if out.exists() else "# Benchmark results\n\n"
    start = text.find(SECTION)
    if start < 0:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(SECTION))
        tail = text[end + 1 :] if end >= 0 else ""
        new = text[:start] + section + ("\n" + tail if tail else "")
    out.write_text(new.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavors", nargs="+", default=["debug", "small"], choices=["debug", "small"])
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch.set_num_threads (default: os.cpu_count())")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(ALL_VARIANTS))
    parser.add_argument("--warmup", type=int, nargs=2, default=[10, 10], metavar=("DEBUG", "SMALL"),
                        help="warm-up steps excluded from the window, per flavor (multiples of 10; default 10 10)")
    parser.add_argument("--window", type=int, nargs=2, default=[100, 20], metavar=("DEBUG", "SMALL"),
                        help="timed steps per run, per flavor (multiples of 10; default 100 20)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of every variant")
    parser.add_argument("--dir", help="parent of the work dir (default benchmarks/_work)")
    parser.add_argument("--out", help="Markdown file in which to add/replace the results section")
    args = parser.parse_args(argv)
    for n in (*args.warmup, *args.window):
        if n < INTERVAL or n % INTERVAL:
            parser.error(f"--warmup and --window must be positive multiples of {INTERVAL}")
    torch.set_num_threads(args.threads)
    os.chdir(REPO)  # BASE_CONFIG and the shipped corpus are relative to the repository

    command = "python " + shlex.join([os.path.relpath(sys.argv[0], REPO) if argv is None else "benchmarks/bench_trainer.py",
                                      *(sys.argv[1:] if argv is None else argv)])
    base = Path(args.dir) if args.dir else REPO / "benchmarks" / "_work"
    base.mkdir(parents=True, exist_ok=True)
    tokens = data_mod.TokenStream(data_mod.load_documents("shipped"), data_mod.ByteTokenizer()).tokens
    cfg = load_config(["--config", BASE_CONFIG])
    results = []
    info: dict = {}
    psi_start, run_start, load_start = pressure_totals(), time.monotonic(), os.getloadavg()[0]
    others_start = top_other_processes()
    try:
        for i, flavor in enumerate(["debug", "small"]):
            if flavor not in args.flavors:
                continue
            fargs = {"warmup": args.warmup[i], "window": args.window[i], "batch": cfg.training.batch_size,
                     "seq_len": cfg.training.seq_len, "params": flavor_params(flavor)}
            variants = [Variant(k, ALL_VARIANTS[k][0], ALL_VARIANTS[k][1]) for k in args.variants]
            run_flavor(flavor, fargs, variants, args.repeats, base, tokens, not args.no_warmup)
            results.append((flavor, fargs, variants))
    finally:
        try:
            base.rmdir()  # only if empty
        except OSError:
            pass
    elapsed = time.monotonic() - run_start
    psi_end = pressure_totals()
    psi = ", ".join(f"{k} {100 * (psi_end[k] - v) / 1e6 / elapsed:.0f}%" for k, v in psi_start.items() if k in psi_end)
    others = top_other_processes()
    info["contention"] = (f"load average {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end (this benchmark "
                          f"itself keeps about {args.threads} busy)"
                          + (f"; time some task stalled (PSI) during the run: {psi}" if psi else "")
                          + f"; other busy processes at start: {'; '.join(others_start) or 'none'}, at end: "
                          + ("; ".join(others) or "none") + f"; run took {elapsed / 60:.1f} min")
    info["machine"] = [
        f"CPU: {cpu_model()}, nproc={os.cpu_count()} (affinity {len(os.sched_getaffinity(0))}); "
        f"torch threads {torch.get_num_threads()} (intra-op), {torch.get_num_interop_threads()} (inter-op)",
        f"Memory: {meminfo()}",
        f"Work dir filesystem: {filesystem_of(base)}",
        f"Kernel: {platform.system()} {platform.release()}; Python {platform.python_version()}; torch {torch.__version__}",
    ]
    info["git"] = git_state()
    info["date"] = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    section = report(results, info, args, command)
    print()
    print(section)
    if args.out:
        write_section(Path(args.out), section)
        print(f"wrote section to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
