"""ckpt-convert: a trainer checkpoint as a Hugging Face model or plain weights files, and back.

    ckpt-convert SRC DST --to hf [--step N] [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]
                                 [--config FILE | --model-args JSON | --flavor FLAVOR] [--force] [--quiet] [--json]
    ckpt-convert SRC DST --to torch|safetensors [--step N] [--dtype ...] [--max-shard-size SIZE] [--force] [--quiet]
    ckpt-convert SRC DST --from hf [--step N] [--dtype ...] [--force] [--quiet] [--json]
    ckpt-convert SRC DST --from dcp [--force] [--quiet] [--json]
    ckpt-convert SRC DST --from torchtitan --flavor FLAVOR [--step N] [--force] [--quiet] [--json]
    ckpt-convert SRC DST --to torchtitan [--step N] [--force] [--quiet] [--json]

--to: SRC is a trainer checkpoint (a directory or URL holding manifest.json) or a checkpoint root
(then --step N, default the newest committed step); its model weights (the tensors under "model.")
are read one whole tensor at a time, every chunk verified, deltas replayed. The model's shapes come
from the run config the trainer recorded in the manifest; a checkpoint that records none (one
imported --from dcp) is told with --config FILE (the trainer config it was trained with: .toml,
.yaml, or the run's config.json) or --model-args JSON (trainer.model.ModelArgs fields, inline or
a .json file); the weights' shapes are checked against it. With --flavor FLAVOR, SRC is a torchtitan
llama3 checkpoint instead (its checkpoint folder: the newest step-N, or --step N; or one step-N
directory, as torchtitan's CheckpointManager writes them; or a step or root of ours written by
ckpt.integrations.torchtitan): its model weights alone are read (DCP pickle-free, as --from dcp
reads) under torchtitan's names, the fused wqkv as its split wq/wk/wv.

  hf           DST is a local directory for transformers' LlamaForCausalLM.from_pretrained: the
               weights under Hugging Face names with the rotary q/k rows permuted to its layout
               (model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json
               beyond --max-shard-size, default 5GB), config.json, generation_config.json, and the
               tokenizer.json + tokenizer_config.json: the run's own tokenizer.json when it used one,
               else the built-in byte tokenizer written as one (ids 0-255 are UTF-8 bytes, 256 BOS,
               257 EOS; needs the tokenizers package), so AutoTokenizer loads the export; none for a
               step imported from torchtitan or from an HF folder that had none (a note says why).
  torch,       the weights under our own names (layers.0.attention.wq.weight: what
  safetensors  trainer.model.Transformer.load_state_dict takes) in one torch.save / .safetensors
               file, or with --max-shard-size a directory of shards + index.

A plug-in's step (SRC written by ckpt.integrations.deepspeed: its save_dir, the tag `latest` names or
global_step<N> with --step N, or a tag; by .lightning: a .ckpt checkpoint, or their folder for last.ckpt;
by .hf: <output_dir>/ckpt, a step of it, or a checkpoint-N folder) exports its model's weights under the
names that framework's model takes: DeepSpeed's module.state_dict() (ZeRO 1/2: the fp32 masters joined
from every rank's partition, as zero_to_fp32.py does), the LightningModule's checkpoint["state_dict"],
the transformers model's own state dict; --to hf only for the HF Trainer's (a transformers model: its
recorded config.json beside the weights, for from_pretrained).

--from hf: SRC is a local Hugging Face llama or Mixtral directory (config.json + model.safetensors, or
shards with model.safetensors.index.json; a Mixtral's experts become our 3-D expert weights); DST
becomes a checkpoint root holding step N (default 0) with the model weights under "model." (floats as
fp32 unless --dtype: the trainer's parameters are fp32), read and written one tensor at a time. The trainer starts from it with
--checkpoint.initial_load_path DST and the --model.* flags printed (weights only; the optimizer,
schedule and data position start fresh).

--from dcp: SRC is a plain torch.distributed.checkpoint directory (.metadata, read without
unpickling code); DST the equivalent checkpoint of this engine (export it --to hf with --config or
--model-args: a DCP checkpoint records no model config).

--from torchtitan: SRC is a torchtitan llama3 checkpoint (its checkpoint folder: the newest step-N,
or --step N; or one step-N directory; or a step or root of ckpt.integrations.torchtitan), FLAVOR its
model flavor (debugmodel, 1B, 3B, 8B, 70B: the numerics are not in the checkpoint); DST becomes a
checkpoint root our trainer resumes with the flags printed: model, AdamW state (the fused wqkv split
per projection), LR schedule position and step (torchtitan's data position is not carried: the data
starts from the beginning).
--to torchtitan: SRC a trainer checkpoint (or root, --step N); DST torchtitan's checkpoint folder,
where step-N is written as the DCP checkpoint its CheckpointManager resumes (with
checkpoint.exclude_from_loading = ["dataloader"]).

Outputs appear whole or not at all (written under a temporary name, renamed at the end); an existing
DST is refused without --force. --json prints one JSON object on stdout instead of the summary
lines (direction, format, source, destination, step, kind, tensors, bytes, the paths written, the
model's arguments, notes); errors are still one line on stderr. Exit codes (tools/cli.py): 0 done,
1 a checkpoint or model could not be read or converted, or the output not written (one line on
stderr says why), 2 bad arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch

import ckpt
from ckpt import CheckpointError, CheckpointNotFoundError
from ckpt.convert import PluginStep, export_plugin_step, import_dcp, open_plugin_step, read_dcp_metadata
from ckpt.convert import total_tensor_bytes
from ckpt.inspect import run_config
from ckpt.root import resolve_checkpoint
from ckpt.storage import is_url
from ckpt.units import human_bytes
from .convert_model import MODEL_OPTIONS, add_model_options, with_model_config
from .cli import DTYPES, EXPECTED_FAILURES, command, fail, implied_format, parse_size, progress

if __package__ == "ckpt_tools":  # installed from a wheel, beside ckpt_trainer (setup.py says why)
    from ckpt_trainer import hf, titan
    from ckpt_trainer.config import ConfigError
else:
    from trainer import hf, titan
    from trainer.config import ConfigError

PROG = "ckpt-convert"
EPILOG = """examples:
  ckpt-convert outputs/debug/checkpoints hf-debug --to hf               newest step as a Hugging Face llama
  ckpt-convert ckpts/run1 hf-1200-bf16 --to hf --step 1200 --dtype bf16 --max-shard-size 2GB
  ckpt-convert s3://bucket/run1 model.safetensors --to safetensors      our names, one file, read from S3
  ckpt-convert ckpts/run1/step-00001200 model.pt --to torch             Transformer.load_state_dict(torch.load(...))
  ckpt-convert hf-llama ckpts/init --from hf                            then: python -m trainer.train ... \\
                                                                          --checkpoint.initial_load_path ckpts/init
  ckpt-convert dcp-ckpt ckpts/imported/step-00000100 --from dcp         a plain DCP checkpoint into this format
  ckpt-convert ckpts/imported hf-imported --to hf --config configs/debug.toml   ... and on to Hugging Face

Sizes: 5GB, 500MB (powers of 1000), 2GiB (powers of 1024), or bytes. URLs (s3://...) take
AWS_ENDPOINT_URL etc. from the environment; --to hf and --from hf need local directories.
"""


def parser() -> argparse.ArgumentParser:
    paragraphs = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog=PROG, description="\n\n".join([paragraphs[0], *paragraphs[2:]]), epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="--to: a checkpoint or checkpoint root (path or URL); --from: the model to import")
    p.add_argument("dst", help="--to hf: a directory; --to torch/safetensors: a file (a directory when sharded); "
                               "--from hf: a new checkpoint root; --from dcp: a checkpoint directory")
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=("hf", "torch", "safetensors", "torchtitan"),
                           help="export the model weights (torchtitan: the whole training state)")
    direction.add_argument("--from", dest="from_", choices=("hf", "dcp", "torchtitan"),
                           help="import into this engine's format")
    p.add_argument("--flavor", help="--from torchtitan, or --to hf/torch/safetensors of a torchtitan checkpoint: "
                                    "the torchtitan llama3 flavor of the run (debugmodel, 1B, ...)")
    p.add_argument("--step", type=int, help="--to with a root SRC: the step to export (default: the newest "
                                            "committed); --from hf: the step to write (default 0)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="convert floating-point tensors (default: --to keeps the "
                                                            "stored dtype, --from hf writes fp32)")
    p.add_argument("--max-shard-size", type=parse_size, metavar="SIZE",
                   help="--to: shard into files of at most SIZE (default for hf: 5GB; torch/safetensors: one file)")
    p.add_argument("--force", action="store_true", help="replace an existing DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary lines")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the summary lines: "
                   "direction, format, source, destination, step, kind, tensors, bytes, paths written, notes")
    add_model_options(p)
    return p


def _check_arguments(p: argparse.ArgumentParser, args) -> None:
    """Usage errors (exit 2) before anything is read."""
    if args.from_ is not None and args.max_shard_size is not None:
        p.error("--max-shard-size applies to --to only")
    if args.from_ == "torchtitan" and not args.flavor:
        p.error("--from torchtitan needs --flavor (torchtitan's llama3 flavor: debugmodel, 1B, 3B, 8B, 70B)")
    if args.flavor and args.from_ != "torchtitan" and args.to not in ("hf", "torch", "safetensors"):
        p.error("--flavor applies to --from torchtitan and to --to hf/torch/safetensors of a torchtitan checkpoint")
    if args.flavor and (args.config or args.model_args):
        p.error(f"--flavor names a torchtitan checkpoint's model; {MODEL_OPTIONS} do not apply to it")
    if "torchtitan" in (args.to, args.from_) and (args.dtype is not None or args.max_shard_size is not None):
        p.error("torchtitan conversions take neither --dtype nor --max-shard-size (the state is converted as it is)")
    if args.from_ == "dcp" and (args.step is not None or args.dtype is not None):
        p.error("--from dcp takes neither --step nor --dtype (the checkpoint is imported as it is)")
    if args.to not in ("hf", "torch", "safetensors") and (args.config or args.model_args):
        p.error(f"{MODEL_OPTIONS} apply to --to hf/torch/safetensors only (the model a checkpoint without a "
                "recorded run config holds)")
    if args.config and args.model_args:
        p.error("give --config or --model-args, not both")
    if args.step is not None and args.step < 0:
        p.error(f"--step must be >= 0, not {args.step}")
    if (args.to == "hf" or args.from_ == "hf") and is_url(args.dst if args.to == "hf" else args.src):
        p.error(f"--{'to' if args.to else 'from'} hf needs a local directory, not {args.dst if args.to else args.src}")
    if args.to in ("torch", "safetensors"):
        suffix, implied = implied_format(args.dst)
        if implied is not None and implied != args.to:
            p.error(f"DST's extension {suffix} is for --to {implied}, not --to {args.to}")
        if implied is not None and args.max_shard_size is not None:
            p.error(f"--max-shard-size writes a directory; name DST without a file extension (not {suffix})")


@command(PROG)
def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    _check_arguments(p, args)
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        if "torchtitan" in (args.to, args.from_):
            lines, report = _torchtitan(args)
        elif args.to is not None:
            lines, report = _export(args, dtype)
        elif args.from_ == "hf":
            lines, report = _import_hf(args, dtype)
        else:
            lines, report = _import_dcp(args)
    except (*EXPECTED_FAILURES, ConfigError) as exc:
        return fail(PROG, exc, forced=args.force)
    except RuntimeError as exc:  # torch's zip writer reports a failed write as RuntimeError
        return fail(PROG, CheckpointError(f"writing {args.dst} failed: {exc}"), forced=args.force)
    if args.json:
        print(json.dumps({"direction": "to" if args.to else "from", "format": args.to or args.from_,
                          "source": str(args.src), "destination": str(args.dst), **report}))
    elif not args.quiet:
        print("\n".join(lines))
    return 0


def _export(args, dtype: torch.dtype | None) -> tuple[list[str], dict]:
    if args.flavor:  # a torchtitan checkpoint: its model weights, imported alone, then exported
        with tempfile.TemporaryDirectory(prefix=".ckpt-convert-torchtitan-") as tmp:
            imported = titan.import_torchtitan(args.src, tmp, flavor=args.flavor, step=args.step, model_only=True)
            return _export_step(args, dtype, imported.path, imported.source)
    plugin = open_plugin_step(args.src, args.step)
    if plugin is not None:
        return _export_plugin(args, dtype, plugin)
    try:
        source = resolve_checkpoint(args.src, args.step)
    except CheckpointNotFoundError as exc:
        local = Path(args.src) if not is_url(args.src) else None
        if local is not None and (local / "config.json").is_file() and any(local.glob("*.safetensors*")):
            raise CheckpointNotFoundError(f"{exc}; it is a Hugging Face model directory: import it with --from hf",
                                          path=exc.path) from None
        if local is not None and _is_torchtitan(local, args.step):
            raise CheckpointNotFoundError(f"{exc}; it is a torchtitan checkpoint: export it with --flavor FLAVOR "
                                          "(its llama3 flavor: debugmodel, 1B, 3B, 8B, 70B)", path=exc.path) from None
        raise
    return _export_step(args, dtype, source, source)


def _is_torchtitan(path: Path, step: int | None) -> bool:
    try:
        titan.titan_step_dir(path, step)
    except CheckpointNotFoundError:
        return False
    return True


def _export_step(args, dtype: torch.dtype | None, source, origin) -> tuple[list[str], dict]:
    """Export the trainer checkpoint ``source``; ``origin``: what the user named (a torchtitan step
    directory, where ``source`` is its model imported alone)."""
    manifest = with_model_config(ckpt.read_manifest(source), args)
    titan_names = any(key.startswith("layers.0.attention.qkv_linear.") for key in manifest.tensors)
    if run_config(manifest) is None and titan_names:
        raise CheckpointError(f"{source} holds torchtitan's model names (a step of ckpt.integrations.torchtitan): "
                              "export it with --flavor FLAVOR (its llama3 flavor: debugmodel, 1B, 3B, 8B, 70B)",
                              path=str(source))
    if args.to == "hf" and run_config(manifest) is None:
        raise CheckpointError(f"{source} records no run config (a checkpoint imported --from dcp, or saved outside "
                              "the trainer), so its model is unknown: name it with --config FILE (the trainer config "
                              "it was trained with) or --model-args JSON", path=str(source))
    step = "" if manifest.step is None else f"step {manifest.step} "
    with progress(hf.export_bytes(manifest, dtype), f"convert {step}".strip(), quiet=args.quiet or args.json) as bar:
        if args.to == "hf":
            result = hf.export_hf(source, args.dst, dtype=dtype, max_shard_size=args.max_shard_size or
                                  hf.DEFAULT_HF_SHARD, overwrite=args.force, progress=bar.update, manifest=manifest)
        else:
            result = hf.export_weights(source, args.dst, format=args.to, dtype=dtype,
                                       max_shard_size=args.max_shard_size, overwrite=args.force, progress=bar.update,
                                       manifest=manifest)
    weights = result.weight_files
    shards = f"{len(weights)} shards + index" if len(weights) > 1 else Path(weights[0]).name
    report = {"step": manifest.step, "kind": manifest.kind, "checkpoint": str(origin), "tensors": result.tensors,
              "bytes": result.nbytes, "written": [str(f) for f in result.files], "model": dataclasses.asdict(result.args) if result.args else None,
              "verified": "every chunk read", "note": result.note or None}
    if args.to == "hf":
        return [f"{step}({manifest.kind}) of {origin} -> {args.dst}: "
                f"LlamaForCausalLM ({hf.describe(result.args)}), "
                f"{result.tensors} tensors, {human_bytes(result.nbytes)} in {shards}, config.json, "
                f"generation_config.json; {result.note}"], report
    return [f"{step}({manifest.kind}) of {origin}: {result.tensors} model tensors, {human_bytes(result.nbytes)} as "
            f"{args.to} -> {args.dst}" + (f" ({shards})" if len(weights) > 1 else "")], report


def _export_plugin(args, dtype: torch.dtype | None, plugin: PluginStep) -> tuple[list[str], dict]:
    """A plug-in's step: its model's weights under its framework's names (ckpt.convert.plugins)."""
    if args.config or args.model_args:
        raise CheckpointError(f"{plugin.path} is a step of the {plugin.framework} plug-in: {MODEL_OPTIONS} describe "
                              "our trainer's model, not its", path=plugin.path)
    specs = plugin.specs(dtype)
    total = sum(s.nbytes for s in specs)
    with progress(total, f"convert {plugin.framework}", quiet=args.quiet or args.json) as bar:
        written = export_plugin_step(plugin, args.dst, format=args.to, dtype=dtype, overwrite=args.force,
                                     max_shard_size=args.max_shard_size, progress=bar.update)
    report = {"step": plugin.step, "kind": plugin.manifest.kind, "checkpoint": plugin.path,
              "framework": plugin.framework, "tensors": len(specs), "bytes": total, "written": written,
              "verified": "every chunk read"}
    return [f"{plugin.framework} step {plugin.step} ({plugin.path}) -> {args.dst}: {len(specs)} tensors, "
            f"{human_bytes(total)} as {args.to} ({plugin.takes} takes them)"], report


def _import_hf(args, dtype: torch.dtype | None) -> tuple[list[str], dict]:
    model = hf.open_hf(args.src)
    with progress(model.import_bytes(dtype or torch.float32), "import hf", quiet=args.quiet or args.json) as bar:
        result = hf.import_hf(args.src, args.dst, step=args.step or 0, dtype=dtype or torch.float32,
                              overwrite=args.force, progress=bar.update)
    lines = [f"Hugging Face {'mixtral' if result.model.args.is_moe else 'llama'} {args.src} "
             f"({hf.describe(result.model.args)}) -> {result.path}: "
             f"{result.tensors} tensors, {human_bytes(result.nbytes)}"]
    flags = hf.trainer_flags(result.model_config) if result.model_config is not None else None
    notes = []
    if result.model_config is None:
        notes.append("no trainer configuration rebuilds this model exactly; "
                     "trainer.model.Transformer(ModelArgs(**manifest.user['model_args'])) loads it with ckpt.load")
    else:
        lines.append("start training from it: python -m trainer.train --config <your config> "
                     f"{' '.join(flags)} --checkpoint.initial_load_path {os.path.abspath(args.dst)}")
        byte_model = result.model.config.get("bos_token_id") == 256 and result.model.args.vocab_size == 258
        if result.model.tokenizer is None and not byte_model:
            notes.append(f"{args.src} has no tokenizer.json; the trainer then uses its byte tokenizer, whose "
                         "ids are not this model's")
    lines += [f"note: {text}" for text in notes]
    return lines, {"step": args.step or 0, "kind": "full", "written": [result.path], "tensors": result.tensors,
                   "bytes": result.nbytes, "model": dataclasses.asdict(result.model.args), "trainer_flags": flags,
                   "notes": notes}


def _torchtitan(args) -> tuple[list[str], dict]:
    if args.to == "torchtitan":
        path, tensors = titan.export_torchtitan(args.src, args.dst, step=args.step, overwrite=args.force)
        return [f"{args.src} -> {path}: a torchtitan DCP checkpoint ({tensors} tensors); torchtitan resumes it with "
                f"--checkpoint.folder {os.path.abspath(args.dst)} --checkpoint.exclude_from_loading dataloader"], \
            {"written": [str(path)], "tensors": tensors}
    result = titan.import_torchtitan(args.src, args.dst, flavor=args.flavor, step=args.step, overwrite=args.force)
    lines = [f"torchtitan llama3 {args.src} ({hf.describe(result.args)}) -> {result.path}: step {result.step}, "
             f"{result.tensors} tensors (model, optimizer); left out: {', '.join(result.left_out) or 'nothing'}"]
    flags = hf.trainer_flags(result.model_config) if result.model_config else []
    lines.append("resume training from it: python -m trainer.train --config <your config> "
                 f"{' '.join(flags)} --checkpoint.enable --checkpoint.folder {os.path.abspath(args.dst)}")
    return lines, {"step": result.step, "written": [str(result.path)], "tensors": result.tensors,
                   "model": dataclasses.asdict(result.args), "trainer_flags": flags, "left_out": result.left_out}


def _import_dcp(args) -> tuple[list[str], dict]:
    total = total_tensor_bytes(read_dcp_metadata(args.src))
    with progress(total, "import dcp", quiet=args.quiet or args.json) as bar:
        manifest = import_dcp(args.src, args.dst, overwrite=args.force, progress=bar.update)
    step = "" if manifest.step is None else f"step {manifest.step}, "
    return [f"DCP checkpoint {args.src} -> {args.dst} ({step}{len(manifest.tensors)} tensors, "
            f"{human_bytes(total)}, {len(manifest.values)} values)"], \
        {"step": manifest.step, "kind": manifest.kind, "written": [str(args.dst)], "tensors": len(manifest.tensors),
         "values": len(manifest.values), "bytes": total, "verified": "every chunk checked against the metadata"}


if __name__ == "__main__":
    raise SystemExit(main())
