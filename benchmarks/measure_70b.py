"""The 70B layouts through the measured dry run (trainer.measure): planned vs measured per rank role.

    python benchmarks/measure_70b.py [--out DIR] [--only torchtitan|seed|seed-lean|article]

* torchtitan: its published Llama 3.1 70B run (256 GPUs, FSDP 32 x TP 8, local batch 16, seq 8192,
  vocabulary 128256, full AC, loss parallel; 71.9 GiB measured there), as it ran (no chunked loss)
  and with this trainer's default chunked loss; about a minute each.
* seed: configs/seed_70b.yaml at the seeds' sequence length 2048, its batch made consistent with
  training.batch_size=32 (the file's 1 x 8 x 4; its 256 would be 64 microbatches: the same memory
  under 1F1B, eight times the time), three pipeline roles, about six minutes; seed-lean: the same
  with bf16 masters and moments.
* article: the seed article's FSDP table (7B/13B/70B on 8 cards, seq 2048, batch 1 per card:
  8.2 / 14.8 / 76 GB) beside the plan in every precision, planned only (no measurement: 8-rank
  70B without TP is 80 layers of unsharded work per step, as slow as torchtitan's).

Writes DIR/measure_70b.json and DIR/measure_70b.md (default DIR: a fresh temporary folder, printed);
never the tracked results. The figures in docs/DRY_RUN.md come from this script.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEBUG, SEED = str(REPO / "configs" / "debug.toml"), str(REPO / "configs" / "seed_70b.yaml")
BF16_AC = ["--optimization.precision=bf16", "--optimization.gradient_checkpointing=true"]
TORCHTITAN = ["--config", DEBUG, "--model.flavor=70b", "--model.vocab_size=128256", "--training.seq_len=8192",
              "--training.batch_size=512", "--training.micro_batch_size=16", "--parallelism.tp=8",
              "--optimization.zero_stage=3", *BF16_AC]
LEAN = ["--optimization.master_dtype=bf16", "--optimization.optimizer_state_dtype=bf16"]
CASES = {
    "torchtitan": [("as run (loss parallel, no chunking)", 256, [*TORCHTITAN, "--optimization.loss_chunk_len=0"]),
                   ("this trainer's default (chunked loss)", 256, TORCHTITAN)],
    "seed": [("seed_70b.yaml, seq 2048, batch 32", 64, ["--config", SEED, "--training.seq_len=2048",
                                                          "--training.batch_size=32"])],
    "seed-lean": [("seed_70b.yaml, seq 2048, batch 32, bf16 masters + moments", 64,
                   ["--config", SEED, "--training.seq_len=2048", "--training.batch_size=32", *LEAN])],
}
ARTICLE = {"7b": 8.2, "13b": 14.8, "70b": 76.0}  # GB per card, FSDP over 8 Ascend 910, seq 2048, batch 1


def measured(argv: list[str], world: int) -> list[dict]:
    from trainer.config import load_config
    from trainer.measure.cli import comparison, measure_roles
    from trainer.plan import plan

    cfg = load_config(argv)
    result = plan(cfg, world)
    return comparison(result, measure_roles(cfg, world, [r["stage"] for r in result.roles]))


def article() -> list[dict]:
    from trainer.config import load_config
    from trainer.plan import plan

    rows = []
    for flavor, gb in ARTICLE.items():
        row = {"flavor": flavor, "article_gib": round(gb * 1e9 / 2**30, 1)}
        for name, extra in (("fp32 masters + moments", []), ("bf16 moments", LEAN[1:]), ("bf16 masters + moments", LEAN)):
            for ac in ("false", "true"):
                cfg = load_config(["--config", DEBUG, f"--model.flavor={flavor}", "--model.vocab_size=32000",
                                   "--training.seq_len=2048", "--training.batch_size=8", "--optimization.precision=bf16",
                                   "--optimization.zero_stage=3", f"--optimization.gradient_checkpointing={ac}", *extra])
                row[f"{name}, AC {'on' if ac == 'true' else 'off'}"] = round(plan(cfg, 8).peak / 2**30, 1)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", choices=[*CASES, "article"], action="append")
    ns = parser.parse_args()
    out = ns.out or Path(tempfile.mkdtemp(prefix="measure_70b-"))
    out.mkdir(parents=True, exist_ok=True)
    results, lines = {}, ["| layout | role | planned GiB | measured GiB | measured/planned | s |", "|---|---|---:|---:|---:|---:|"]
    for key in ns.only or [*CASES, "article"]:
        if key == "article":
            results["article"] = article()
            continue
        for name, world, argv in CASES[key]:
            started = time.perf_counter()
            rows = measured(argv, world)
            results[f"{key}: {name}"] = {"world_size": world, "argv": argv, "rows": rows,
                                         "seconds": round(time.perf_counter() - started, 1)}
            for r in rows:
                lines.append(f"| {name} | {r['role']} | {r['planned_bytes'] / 2**30:.2f} | "
                             f"{r['measured_bytes'] / 2**30:.2f} | {r['ratio']:.3f} | {r['seconds']} |")
            print(lines[-1], flush=True)
    if "article" in results:
        keys = [k for k in results["article"][0] if k not in ("flavor", "article_gib")]
        lines += ["", "| flavor | article (GiB) | " + " | ".join(keys) + " |", "|---|---:|" + "---:|" * len(keys)]
        lines += [f"| {r['flavor']} | {r['article_gib']} | " + " | ".join(str(r[k]) for k in keys) + " |"
                  for r in results["article"]]
    (out / "measure_70b.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "measure_70b.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written: {out / 'measure_70b.json'}, {out / 'measure_70b.md'}")


if __name__ == "__main__":
    main()
