#!/usr/bin/env python
"""Integrations: our plug-ins against each framework's default saving, same model, same run (issue 24).

    python benchmarks/bench_integrations.py --quick                 # smoke run, one repeat, 1 thread (~2 min)
    python benchmarks/bench_integrations.py --tiny                  # the tests' smoke run (1 layer, 6 steps)
    python benchmarks/bench_integrations.py                         # 3 repeats (run.py's full run; ~12 min)
    python benchmarks/bench_integrations.py --hidden 256 --layers 4 --steps 42 --every 10   # a larger model
    python benchmarks/bench_integrations.py --json /tmp/integrations.json   # the runner's record, elsewhere

One process on CPU, ``torch.set_num_threads(--threads)``. The model is the same for both frameworks:
a tiny ``LlamaForCausalLM`` (``--hidden``, ``--layers``: 128 x 2 by default, ~0.66 M parameters; vocab 1024, sequence 64, batch 4) with AdamW,
trained ``--steps`` steps on random tokens. Per framework, after one unmeasured warm-up run of each
variant (first-call costs), these variants run interleaved (every
repeat runs each once, in an order rotated per repeat; the tables show medians over repeats):

none        no checkpoints.
default     the framework's own saving every ``--every`` steps: Lightning's ``ModelCheckpoint`` with its
            default ``TorchCheckpointIO`` (``torch.save``); the HF ``Trainer``'s ``save_steps``
            (``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``).
ours        the same schedule through our plug-in: ``CkptCheckpointIO()`` (async double buffer) and
            ``CkptCallback()`` (a ``CheckpointManager``, async).

tokens/s: window steps x batch x sequence / the time from the start of the first window step (after
``--warmup`` steps) to the start of the last step, taken at each step's start (Lightning's
``on_train_batch_start``, the Trainer's ``on_step_begin``), so the window holds the saves, their
snapshot waits and any slowdown they cause, not the final flush. Blocked per checkpoint: (window time
with checkpoints - window time without) / saves in the window, from the same repeat; "counted": the
save call plus, for ours, the waits for its snapshot that the plug-in's stall counter saw after the
call returned (the synchronous default: its save call); also the time inside the save call itself (Lightning: ``strategy.save_checkpoint``; HF: ``Trainer._save_checkpoint``
for the default, the callback's save for ours). Both frameworks keep 2 checkpoints
(``save_top_k=2``/``save_total_limit=2``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings

import torch

from harness import REPO, Load, argument_parser, machine_description, median, rotated, work_dir  # first

from report import command_line, metric, provenance, publish, table_head, write_json  # noqa: E402

BENCH_NAME = "integrations"
SECTION = "## Integrations: Lightning and the HF Trainer, ours vs the default saving (issue 24)"
VOCAB, SEQ, BATCH = 1024, 64, 4
QUICK = {"hidden": 128, "layers": 2, "steps": 18, "every": 6, "warmup": 3, "repeats": 1}
TINY = {"hidden": 32, "layers": 1, "steps": 6, "every": 2, "warmup": 1, "repeats": 1}  # the tests' smoke run
FULL = {"hidden": 128, "layers": 2, "steps": 26, "every": 8, "warmup": 3, "repeats": 3}  # minutes on 2 shared cores
VARIANTS = ("none", "default", "ours")

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def llama(hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=SEQ))


def tokens(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))


class Marks:
    """Step-start times, the time spent inside the wrapped save calls and, for ours, the plug-in's
    stall counter (``stats_of()``: the SaveStats, with ``stall_s``, or None before the first save)."""

    def __init__(self):
        self.starts: list[float] = []
        self.save_s: list[float] = []
        self.stats_of = lambda: None
        self._inside = 0.0  # the plug-in's stall counted during the wrapped calls
        self._stall_at_start = 0.0  # ... in all, at the start of the latest step (not the final flush)

    def step_started(self) -> None:
        self.starts.append(time.perf_counter())
        self._stall_at_start = self._stall()

    def _stall(self) -> float:
        stats = self.stats_of()
        return 0.0 if stats is None else stats.stall_s

    def stall_per_save(self) -> float:
        """Blocked per checkpoint as counted: the save call, plus (ours) the waits for the snapshot
        the plug-in counted after the call returned (before the next optimizer step or forward); the
        default saves synchronously, so its save call is all of it."""
        if not self.save_s:
            return 0.0
        return (sum(self.save_s) + self._stall_at_start - self._inside) / len(self.save_s)

    def wrap(self, owner, name: str, when=lambda *args: True) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if not when(*args):
                return inner(*args, **kwargs)
            start, before = time.perf_counter(), self._stall()
            try:
                return inner(*args, **kwargs)
            finally:
                self.save_s.append(time.perf_counter() - start)
                self._inside += self._stall() - before

        setattr(owner, name, timed)


def run_lightning(variant: str, work, p: dict) -> Marks:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckpt.integrations.lightning import CkptCheckpointIO

    marks = Marks()

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = llama(p["hidden"], p["layers"])

        def training_step(self, batch, _):
            return self.model(input_ids=batch, labels=batch).loss

        def on_train_batch_start(self, *_):
            marks.step_started()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(tokens(p["steps"] * BATCH), batch_size=BATCH)

    callbacks = [] if variant == "none" else [ModelCheckpoint(dirpath=str(work), every_n_train_steps=p["every"],
                                                              save_top_k=2, monitor="step", mode="max")]
    plugins = [CkptCheckpointIO()] if variant == "ours" else []
    if plugins:
        marks.stats_of = lambda: plugins[0].stats
    trainer = pl.Trainer(max_steps=p["steps"], accelerator="cpu", devices=1, callbacks=callbacks, plugins=plugins,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=variant != "none")
    marks.wrap(trainer.strategy, "save_checkpoint")
    trainer.fit(Module())
    return marks


def run_hf(variant: str, work, p: dict) -> Marks:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ckpt.integrations.hf import CkptCallback

    marks = Marks()

    class Starts(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks.step_started()

    class Data(torch.utils.data.Dataset):
        ids = tokens(p["steps"] * BATCH)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    args = TrainingArguments(output_dir=str(work), max_steps=p["steps"], per_device_train_batch_size=BATCH,
                             save_strategy="no" if variant == "none" else "steps", save_steps=p["every"],
                             save_total_limit=2, logging_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-3)
    ours = CkptCallback() if variant == "ours" else None
    trainer = Trainer(model=llama(p["hidden"], p["layers"]), args=args, train_dataset=Data(),
                      callbacks=[Starts(), *([ours] if ours else [])])
    if ours is not None:  # the callback runs every step: time the calls that save
        seen = {}

        def stats_of():  # the manager exists from the first save to the end of train()
            if ours.manager is not None:
                seen["stats"] = ours.manager.stats
            return seen.get("stats")

        marks.stats_of = stats_of
        for hook in ("on_step_end", "on_epoch_end"):  # the public hooks it saves from, when the Trainer asks
            marks.wrap(ours, hook, when=lambda args, state, control: control.should_save)
    else:
        marks.wrap(trainer, "_save_checkpoint")
    trainer.train()
    return marks


FRAMEWORKS = {"lightning": ("Lightning (CheckpointIO)", run_lightning), "hf": ("HF Trainer (callback)", run_hf)}


def measure(framework: str, p: dict, parent: str | None, warm_up: bool = True) -> dict:
    """Per variant: window seconds, saves in the window, save-call seconds, per repeat."""
    runner = FRAMEWORKS[framework][1]
    found = {v: {"window": [], "saves": [], "call": [], "stall": []} for v in VARIANTS}
    for variant in VARIANTS if warm_up else ():  # warm-up (not measured): first-call costs of each saver
        with work_dir(parent, f"integrations-{framework}-warmup-") as work:
            runner(variant, work, {**p, "steps": p["every"] + 2})
    for rep in range(p["repeats"]):
        for variant in rotated(VARIANTS, rep):
            with work_dir(parent, f"integrations-{framework}-{variant}-") as work:
                marks = runner(variant, work, p)
            starts = marks.starts
            first, last = p["warmup"], len(starts) - 1
            window = starts[last] - starts[first]
            saves = sum(1 for s in range(first + 1, last + 1) if s % p["every"] == 0)  # step s saved before start s
            found[variant]["window"].append(window)
            found[variant]["saves"].append(saves if variant != "none" else 0)
            found[variant]["call"].append(median(marks.save_s) if marks.save_s else 0.0)
            found[variant]["stall"].append(marks.stall_per_save())
            print(f"  {framework} {variant}: window {window:.2f} s, {saves} saves, "
                  f"save call {found[variant]['call'][-1] * 1e3:.1f} ms, "
                  f"stall {found[variant]['stall'][-1] * 1e3:.1f} ms", flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke sizes, one repeat")
    parser.add_argument("--tiny", action="store_true", help="the tests' run: a 1-layer model, 6 steps, 2 saves, no warm-up runs")
    parser.add_argument("--threads", type=int, help="torch threads (default 2; 1 with --quick or --tiny: two spin in "
                                                    "OpenMP's barriers when other jobs hold the cores)")
    parser.add_argument("--frameworks", nargs="+", choices=sorted(FRAMEWORKS), default=["lightning", "hf"])
    for key, value in FULL.items():
        parser.add_argument(f"--{key}", type=int, default=None, help=f"default {value} ({QUICK[key]} with --quick)")
    args = parser.parse_args(argv)
    p = {k: getattr(args, k) if getattr(args, k) is not None else (TINY if args.tiny else QUICK if args.quick else FULL)[k]
         for k in FULL}
    args.threads = args.threads or (1 if args.quick or args.tiny else 2)
    torch.set_num_threads(args.threads)
    load = Load()
    results = {fw: measure(fw, p, args.dir, warm_up=not args.tiny) for fw in args.frameworks}
    load.stop()
    params = sum(x.numel() for x in llama(p["hidden"], p["layers"]).parameters())
    state_mib = params * 4 * 3 / 2**20  # fp32 weights + AdamW's two moments
    window_steps = p["steps"] - 1 - p["warmup"]
    lines = [SECTION, "", f"Tiny LlamaForCausalLM, {params / 1e6:.2f} M parameters (~{state_mib:.0f} MiB of "
             f"weights + AdamW state), batch {BATCH} x {SEQ} tokens, {p['steps']} steps, a checkpoint every "
             f"{p['every']} steps, {args.threads} threads, median of {p['repeats']} repeat(s).", "",
             *table_head(["framework", "saving", "tokens/s", "vs none", "blocked per checkpoint (window)",
                          "blocked per checkpoint (counted)", "in the save call"], "llrrrrr")]
    metrics = []
    for fw, found in results.items():
        none = found["none"]["window"]
        for variant in VARIANTS:
            w = found[variant]["window"]
            tps = [window_steps * BATCH * SEQ / x for x in w]
            blocked = [(x - n) / s for x, n, s in zip(w, none, found[variant]["saves"]) if s]
            call, stall = found[variant]["call"], found[variant]["stall"]
            label = {"none": "none", "default": "framework default", "ours": "ours (plug-in)"}[variant]
            lines.append(f"| {FRAMEWORKS[fw][0]} | {label} | {median(tps):,.0f} | {median([n / x for n, x in zip(none, w)]):.3f}x | "
                         + (f"{median(blocked) * 1e3:.1f} ms | {median(stall) * 1e3:.1f} ms | {median(call) * 1e3:.1f} ms |"
                            if blocked else "- | - | - |"))
            system = f"{fw} {variant}"
            metrics.append(metric(system, "tokens_per_s", "tokens/s", tps))
            if blocked:
                metrics.append(metric(system, "blocked_per_checkpoint_s", "s", blocked))
                metrics.append(metric(system, "save_call_s", "s", call))
                metrics.append(metric(system, "stall_per_checkpoint_s", "s", stall))
    lines += ["", "Blocked per checkpoint (window) = (window with checkpoints - window without) / saves in the window, "
              "same repeat: everything a save costs the run, and everything the machine's other load did to that "
              "window; it can come out negative when the difference is in the noise. Blocked per checkpoint "
              "(counted): the save call plus, for ours, the waits for its snapshot that the plug-in counted "
              "after the call (before the next step); the default saves synchronously, so its save call. In the save call: the "
              "median time inside the framework's save call.", "",
              *provenance(machine_description(REPO / "benchmarks"), command_line("bench_integrations.py", argv),
                          load.describe())]
    section = "\n".join(lines)
    publish(section, args.out)
    write_json(args.json, BENCH_NAME, section, command_line("bench_integrations.py", argv), metrics=metrics,
               params=p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
