"""ckpt-merge: one checkpoint's tensors as consolidated weights files (.safetensors or torch.save).

    ckpt-merge SRC DST [--format safetensors|torch] [--dtype bf16|fp16|fp32] [--only model|optim|PREFIX]
                       [--max-shard-size 5GB] [--step N] [--force] [--quiet] [--json]

SRC is one checkpoint (a directory or URL holding manifest.json) or a checkpoint root holding
step-XXXXXXXX directories (then --step N, default the newest committed step). Whatever layout
saved it (FSDP2, TP, any world size) and whether it is a full or a delta step, every tensor is
written whole under its flat key (model.layers.0.attention.wq.weight), one tensor in memory at a
time; every chunk is verified on the way.

DST's extension picks the format: .safetensors, or .pt/.pth/.bin for torch.save (loads with
torch.load(..., weights_only=True) as a flat {key: tensor} dict). With --max-shard-size, DST is a
directory in the Hugging Face layout (model-00001-of-0000N.safetensors + model.safetensors.index.json,
or pytorch_model-*.bin + pytorch_model.bin.index.json); a DST without extension is such a directory
(give --max-shard-size, or --format for one unsharded file in it). Plain (non-tensor) values of the
checkpoint (the step counter, config, RNG state...) are not part of a weights file and are left out;
the safetensors header records the checkpoint's step and kind (ckpt.step, ckpt.kind).

The output appears whole or not at all (written under a temporary name, renamed at the end). Exit
codes (tools/cli.py): 0 done, 1 the checkpoint could not be read or the output written (one line on
stderr says why: a corrupt chunk names its file and tensor), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from ckpt import CheckpointError, read_manifest
from ckpt.convert import merge, select_keys, tensor_specs
from ckpt.root import resolve_checkpoint
from ckpt.units import human_bytes
from .cli import DTYPES, EXPECTED_FAILURES, command, fail, implied_format, parse_size, progress

PROG = "ckpt-merge"
EPILOG = """examples:
  ckpt-merge ckpts/run1 model.safetensors --only model            newest step's weights, one file
  ckpt-merge ckpts/run1 --step 1200 weights.pt --dtype bf16        step 1200 as a torch.save dict, floats in bf16
  ckpt-merge ckpts/run1/step-00001200 shards --max-shard-size 5GB  Hugging Face sharded layout + index
  ckpt-merge s3://bucket/run1 model.safetensors --only model.layers.0.   one prefix, read from S3
  ckpt-merge ckpts/run1 all.safetensors --force --quiet            model + optimizer state, replace all.safetensors

SRC may be a URL (s3://...; AWS_ENDPOINT_URL etc. apply). Sizes: 5GB, 500MB (powers of 1000),
2GiB (powers of 1024), or bytes. Plain (non-tensor) values are not exported.
"""

def parser() -> argparse.ArgumentParser:
    paragraphs = __doc__.split("\n\n")  # the docstring less its synopsis (argparse prints the usage)
    p = argparse.ArgumentParser(prog=PROG, description="\n\n".join([paragraphs[0], *paragraphs[2:]]), epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="a checkpoint (directory or URL), or a root holding step-XXXXXXXX checkpoints")
    p.add_argument("dst", help="output file (.safetensors, .pt, .pth, .bin) or, sharded, a directory")
    p.add_argument("--step", type=int, help="with a root SRC: the step to merge (default: the newest committed)")
    p.add_argument("--format", choices=("safetensors", "torch"), help="output format (default: from DST's extension)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="convert floating-point tensors (integers, bools untouched)")
    p.add_argument("--only", metavar="model|optim|PREFIX",
                   help="only the model's tensors, the optimizer's, or those whose key starts with PREFIX")
    p.add_argument("--max-shard-size", type=parse_size, metavar="SIZE",
                   help="shard into a directory (Hugging Face layout), each file at most SIZE (5GB, 500MB, 2GiB)")
    p.add_argument("--force", action="store_true", help="replace an existing DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary line")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary line: "
                   "source, step, kind, format, tensors, bytes, files written, values left out")
    return p


def output_format(p: argparse.ArgumentParser, args) -> tuple[str, int | None]:
    """(format, max_shard_size) from DST and the options; usage errors exit 2."""
    suffix, implied = implied_format(args.dst)
    if implied is not None:
        if args.max_shard_size is not None:
            p.error(f"--max-shard-size writes a directory; name DST without a file extension (not {suffix})")
        if args.format is not None and args.format != implied:
            p.error(f"DST's extension {suffix} means --format {implied}, not --format {args.format}")
        return implied, None
    if args.max_shard_size is None and args.format is None:
        p.error(f"cannot tell the format of {args.dst!r}: give it a .safetensors/.pt/.pth/.bin extension, or "
                f"--max-shard-size (a sharded directory), or --format (a directory holding one file)")
    return args.format or "safetensors", args.max_shard_size or sys.maxsize


@command(PROG)
def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    fmt, max_shard_size = output_format(p, args)
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        source = resolve_checkpoint(args.src, args.step)
        manifest = read_manifest(source)
        keys = select_keys(manifest, args.only)
        total = sum(s.nbytes for s in tensor_specs(manifest, keys, dtype=dtype))
        label = "merge" if manifest.step is None else f"merge step {manifest.step}"
        with progress(total, label, quiet=args.quiet) as bar:
            written = merge(source, args.dst, format=fmt, dtype=dtype, only=args.only, max_shard_size=max_shard_size,
                            overwrite=args.force, progress=bar.update, manifest=manifest)
    except EXPECTED_FAILURES as exc:
        return fail(PROG, exc, forced=args.force)
    except RuntimeError as exc:  # torch's zip writer reports a failed write as RuntimeError
        return fail(PROG, CheckpointError(f"writing {args.dst} failed: {exc}"), forced=args.force)
    if args.json:
        print(json.dumps({"source": str(source), "step": manifest.step, "kind": manifest.kind, "format": fmt,
                          "tensors": len(keys), "bytes": total, "written": [str(w) for w in written],
                          "values_left_out": len(manifest.values), "verified": "every chunk read"}))
    elif not args.quiet:
        left = f"; {len(manifest.values)} plain value(s) not exported" if manifest.values else ""
        files = f"{len(written)} files in " if len(written) > 1 else ""
        step = "" if manifest.step is None else f"step {manifest.step} "
        print(f"{step}({manifest.kind}): {len(keys)} tensors, {human_bytes(total)} as {fmt} -> "
              f"{files}{args.dst}{left}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
