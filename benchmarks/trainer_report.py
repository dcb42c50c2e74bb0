"""The section of ``bench_trainer.py``: per flavor and thread count, the table of the variants, the
goals with their notes, the per-phase breakdown, and the JSON metrics.

Input: per table ``(title, fargs, variants, breakdown)`` — ``fargs`` the table's parameters
(flavor, threads, warm-up and window steps, batch, seq_len, parameters, repeats), ``variants`` the
``trainer_runs.Variant`` records (per repeat the run records of ``trainer_runs``), ``breakdown``
the median seconds per phase by variant name, or None. Both goals are read on the medians over
repeats; tokens/s = tokens / window time, so a ratio of tokens/s is the inverse ratio of the
median window times. The JSON keys are the runner's contract (benchmarks/README.md).
"""

from __future__ import annotations

from harness import median, paired

from report import goal, median_span, metric, provenance, table_head, verdict
from trainer_runs import BASE_CONFIG, CKPT, INTERVAL, PHASES, Variant

SECTION = "## Trainer throughput (issue 4)"
GOAL_CKPT_RATIO = 0.98  # tokens/s with a save every INTERVAL steps >= 0.98x without
GOAL_OVERHEAD = 0.05  # trainer overhead <= 5%: tokens/s >= (1 - 0.05)x the minimal loop's


def max_loss_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for la, lb in zip(a, b) for x, y in zip(la, lb))


def tokens_per_s(fargs: dict, v: Variant) -> list[float]:
    """tokens/s of each repeat's window."""
    return [fargs["window"] * fargs["batch"] * fargs["seq_len"] / w for w in v.window_s]


def where(fargs: dict) -> str:
    return f"{fargs['flavor']}, {fargs['threads']} thread{'s' if fargs['threads'] > 1 else ''}"


def tokens_goal(name: str, fargs: dict, measured: Variant, reference: Variant, target: float) -> dict:
    """The goal "``measured``'s tokens/s ≥ ``target``× ``reference``'s", on the medians over repeats."""
    per_rep = paired(reference.window_s, measured.window_s)
    return goal(f"{name} ({where(fargs)})", median(reference.window_s) / median(measured.window_s), target, ">=",
                f"medians over {len(per_rep)} repeats: {median(tokens_per_s(fargs, measured)):,.0f} vs "
                f"{median(tokens_per_s(fargs, reference)):,.0f} tokens/s; paired per repeat "
                f"{min(per_rep):.3f}–{max(per_rep):.3f}×")


def flavor_goals(fargs: dict, variants: list[Variant]) -> dict[str, dict]:
    """The two goals of one table: checkpointing's cost and the trainer's overhead."""
    by = {v.key: v for v in variants}
    out = {}
    if "trainer" in by and "trainer_ckpt" in by:
        out["ckpt"] = tokens_goal(f"tokens/s with a save every {INTERVAL} steps ≥ {GOAL_CKPT_RATIO}× without", fargs,
                                  by["trainer_ckpt"], by["trainer"], GOAL_CKPT_RATIO)
    if "trainer" in by and "minimal" in by:
        out["overhead"] = tokens_goal(f"trainer overhead ≤ {GOAL_OVERHEAD:.0%}: tokens/s ≥ {1 - GOAL_OVERHEAD:.2f}× "
                                      "the minimal loop", fargs, by["trainer"], by["minimal"], 1 - GOAL_OVERHEAD)
    return out


def flavor_metrics(fargs: dict, variants: list[Variant]) -> list[dict]:
    """Per variant: tokens/s per repeat; for the checkpointing ones also the stall per save per repeat:
    the time inside ``save()`` (our wrapper) + the snapshot wait before the next optimizer step
    (``manager.stats.stall_s`` minus ``save()``; that difference can come out slightly negative, the
    wrapper timing a little more than the manager's own clock, and then counts as 0)."""
    tags = {"flavor": fargs["flavor"], "threads": fargs["threads"]}
    out = []
    for v in variants:
        out.append(metric(v.label, "tokens_per_s", "tokens/s", tokens_per_s(fargs, v), **tags))
        if "ckpt" in v.key:
            saves = fargs["window"] // INTERVAL
            out.append(metric(v.label, "stall_per_save_s", "s",
                              [max(st, sv) / saves for st, sv in zip(v.stall_s, v.save_s)], **tags))
    return out


def flavor_report(title: str, fargs: dict, variants: list[Variant],
                  breakdown: dict[str, dict[str, float]] | None) -> list[str]:
    by = {v.key: v for v in variants}
    window = fargs["window"]
    tokens = window * fargs["batch"] * fargs["seq_len"]
    lines = [
        f"### {title}",
        "",
        f"{fargs['params'] / 1e6:.2f}M parameters (fp32 weights + AdamW state: {fargs['params'] * 12 / 1e6:.0f} MB "
        f"per checkpoint); batch {fargs['batch']} x seq_len {fargs['seq_len']} = {fargs['batch'] * fargs['seq_len']} "
        f"tokens/step; per run {fargs['warmup']} warm-up steps, a window of {window} steps, 1 final step; "
        f"median of {fargs['repeats']} repeats.",
        "",
        *table_head(["Variant", "tokens/s", "× minimal", "× trainer no ckpt", "window s (min–max)", "ms/step",
                     "train_step ms/step (excl. snapshot wait)", "save() ms/save", "snapshot wait ms/save",
                     "other ms/step", "final step + close s (close)"], "l" + "r" * 10),
    ]
    for v in variants:
        w, c = median(v.window_s), median(v.compute_s)
        nsave = window // INTERVAL if "ckpt" in v.key else 0
        save = median(v.save_s)
        wait = median([st - sv for st, sv in zip(v.stall_s, v.save_s)])
        rel_min = f"{median(by['minimal'].window_s) / w:.3f}" if "minimal" in by else "–"
        rel_trainer = f"{median(by['trainer'].window_s) / w:.3f}" if "trainer" in by else "–"
        lines.append(
            f"| {v.name} | {tokens / w:,.0f} | {rel_min} | {rel_trainer} "
            f"| {median_span(v.window_s, 2)} | {1e3 * w / window:.1f} "
            f"| {1e3 * (c - wait) / window:.1f} | {f'{1e3 * save / nsave:.1f}' if nsave else '–'} "
            f"| {f'{1e3 * wait / nsave:.1f}' if nsave else '–'} | {1e3 * (w - c - save) / window:.2f} "
            f"| {median(v.tail_s):.2f} ({median(v.close_s):.2f}) |")
    notes = []
    goals = flavor_goals(fargs, variants)
    for base_key, ck_key, label in (
        ("trainer", "trainer_ckpt", f"Goal tokens/s with a save every {INTERVAL} steps ≥ {GOAL_CKPT_RATIO}× without"),
        ("trainer", "trainer_sync_ckpt", "The same ratio with synchronous saves (for comparison)"),
    ):
        if base_key not in by or ck_key not in by:
            continue
        base, ck = by[base_key], by[ck_key]
        per_rep = paired(base.window_s, ck.window_s)
        ratio = median(base.window_s) / median(ck.window_s)  # = goals["ckpt"]["measured"] for trainer_ckpt
        extra = median(ck.window_s) - median(base.window_s)
        save, stall = median(ck.save_s), median(ck.stall_s)
        slowdown = (median(ck.compute_s) - (stall - save)) - median(base.compute_s)
        notes.append(
            f"- {label}: {verdict(ratio >= GOAL_CKPT_RATIO)} ({ratio:.3f}× on medians; per repeat "
            f"{', '.join(f'{x:.3f}' for x in per_rep)}; best repeat vs best repeat "
            f"{min(base.window_s) / min(ck.window_s):.3f}×). The window took {extra * 1e3:+.0f} ms longer "
            f"({window // INTERVAL} save{'s' if window // INTERVAL > 1 else ''}): inside `save()` {save * 1e3:.0f} ms, snapshot wait before the optimizer "
            f"step {(stall - save) * 1e3:.0f} ms, the rest of the steps {slowdown * 1e3:+.0f} ms. Once per run, the "
            f"final forced save + `close()` take {median(ck.tail_s):.2f} s vs {median(base.tail_s):.2f} s for the final "
            f"step without checkpointing (not in the ratio).")
        d = max_loss_diff(base.losses, ck.losses)
        notes.append(f"  Losses with and without checkpointing: max |difference| {d:.2g} over all steps and repeats.")
    if "minimal" in by and "trainer" in by:
        m, t = by["minimal"], by["trainer"]
        g = goals["overhead"]
        over = median(t.window_s) / median(m.window_s) - 1
        best = min(t.window_s) / min(m.window_s) - 1
        notes.append(f"- Goal trainer overhead ≤ {GOAL_OVERHEAD:.0%} vs the minimal loop (tokens/s ≥ "
                     f"{1 - GOAL_OVERHEAD:.2f}× the minimal loop's): {verdict(g['met'])} ({g['measured']:.3f}× tokens/s, "
                     f"{over:+.1%} time per step on medians; best repeat vs best repeat {best:+.1%}).")
        notes.append(f"- Losses of the trainer and the minimal loop: max |difference| {max_loss_diff(t.losses, m.losses):.2g} "
                     "(same init, data, hyper-parameters).")
    out = lines + [""] + notes + [""]
    if breakdown:
        out += [
            f"Where the time goes: ms per phase of one step, median over {fargs['breakdown_steps']} steps after "
            f"{fargs['breakdown_skip']} skipped, same phases timed in the same way for each (the trainer rows drive "
            f"the trainer's own model, optimizer, scheduler and loader; no checkpointing):",
            "",
            *table_head(["Variant", *PHASES, "total"], "l" + "r" * (len(PHASES) + 1)),
        ]
        for name, phases in breakdown.items():
            out.append(f"| {name} | " + " | ".join(f"{1e3 * phases[p]:.1f}" for p in PHASES)
                       + f" | {1e3 * sum(phases.values()):.1f} |")
        out.append("")
    return out


def report(results: list[tuple[str, dict, list[Variant], dict | None]], info: dict, args, command: str) -> str:
    body = [
        SECTION,
        "",
        f"Single process on CPU, torch intra-op threads set explicitly per table (`torch.set_num_threads`). Trainer "
        f"runs are `Trainer(load_config(argv))` with `--config {BASE_CONFIG} --model.flavor F --training.steps N "
        f"--training.device cpu --metrics.log_freq 1000000000 --job.dump_folder <tmp>` plus the variant's overrides "
        f"(one data-parallel rank: the trainer trains the model unwrapped, in the 1-rank gloo group it starts "
        f"itself; Python's automatic garbage collection is off, generations 0-1 collected every 50 steps, "
        f"`training.gc_freq`); ckpt = `{' '.join(CKPT)}` (keep 3, local "
        f"disk, full checkpoints). The minimal loop: the same model args and seed, the same loader, AdamW (same "
        f"hyper-parameters, same LR schedule), `model(inputs)`, `cross_entropy`, `backward`, `clip_grad_norm_`, "
        f"`step`, `zero_grad`, `loss.item()`; no process group, no wrapper. Variants interleaved, order rotated per "
        f"repeat; medians. tokens/s over a window of steady-state steps that starts after the warm-up steps and ends "
        f"at the start of the final step: it holds window/{INTERVAL} saves (their `save()` calls and the snapshot "
        f"waits before the next optimizer step) and overlaps as many background writes; the final step (forced save) "
        f"+ `close()` (waits for the writes) is reported separately. 'train_step' = forward/backward/clip/optimizer; "
        f"'other' = loss all-reduce, bookkeeping and the benchmark's marks. "
        f"{'An untimed warm-up run of every variant came first (once, before the first table).' if not args.no_warmup else ''}",
        "",
    ]
    for title, fargs, variants, breakdown in results:
        body += flavor_report(title, fargs, variants, breakdown)
    body += [
        *provenance(info["machine"], command, load=info["contention"], extra=[f"Code: {info['git']}"]),
    ]
    return "\n".join(body)
