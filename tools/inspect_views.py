"""What ``ckpt-inspect`` prints for one thing rather than a run: a checkpoint (``ROOT/step-N``), a
``.safetensors`` file, a Hugging Face model directory, or two checkpoints compared (``--diff``).

Each view takes the JSON-ready dict the library builds (:func:`ckpt.inspect.report.summarize`,
:mod:`ckpt.inspect.weights`, :func:`ckpt.inspect.diff.diff`) and prints it as one JSON document
(``--json``) or as text: a header line, totals, the sizes per prefix, the tensor table, the values
with their previews and the recorded run config (at most :data:`CONFIG_LINES` lines). Text is
printed with what the terminal cannot encode escaped (:func:`printable`): a key holding a lone surrogate
(valid JSON, ``"\\ud800"``) shows as ``\\ud800``, as ``--json`` writes it, instead of crashing.
"""

from __future__ import annotations

import json
import sys
import time

from ckpt.inspect import config_lines
from ckpt.units import human_bytes

CONFIG_LINES = 80
SHOWN_DIFF = 200  # a diff lists at most this many tensors per state (the JSON lists them all)


def printable(text: str) -> str:
    """``text`` with what stdout's encoding cannot hold escaped (``\\ud800``, ``\\xe9``): keys and
    values come from the checkpoint and may hold lone surrogates, which no encoding accepts."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    return text.encode(encoding, "backslashreplace").decode(encoding)


def say(text: str = "") -> None:
    print(printable(text))


def when(created: float | None) -> str:
    return "-" if not created else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [["-" if c is None else printable(str(c)) for c in row] for row in rows]  # aligned as shown
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def shape(dims) -> str:
    return "x".join(map(str, dims)) or "()"


def _emit(doc: dict, as_json: bool) -> bool:
    if as_json:
        print(json.dumps(doc, indent=2))  # ASCII: json escapes the rest
    return as_json


def checkpoint(doc: dict, as_json: bool) -> None:
    """One checkpoint of ours (:func:`ckpt.inspect.report.summarize`)."""
    if _emit(doc, as_json):
        return
    version, totals, tensors, values = doc["format_version"], doc["totals"], doc["tensors"], doc["values"]
    base = "-" if doc["base"] is None else f"{doc['base']} (step {doc['base_step']})"
    say(f"{doc['path']}\nstep {doc['step']}  kind {doc['kind']}  base {base}  world size {doc['world_size']}  "
        f"created {when(doc['created'])}  format version {version if version is not None else '?'}")
    say(f"{totals['tensors']} tensors in {totals['chunks']} chunks, {totals['values']} values; stored "
        f"{human_bytes(totals['stored_bytes'])} ({human_bytes(totals['raw_bytes'])} raw) in "
        f"{totals['files']} data file(s)")
    if any(r["tensors"] for r in doc["prefixes"].values()):
        say()
        say(table(["prefix", "tensors", "elements", "raw", "stored", "values"],
                  [[p, r["tensors"], f"{r['elements']:,}", human_bytes(r["raw_bytes"]), human_bytes(r["stored_bytes"]),
                    r["values"]] for p, r in doc["prefixes"].items() if r["tensors"]]))
    if tensors:
        say()
        say(table(["tensor", "dtype", "shape", "chunks", "stored", "codecs"],
                  [[key, t["dtype"], shape(t["shape"]), t["chunks"], human_bytes(t["stored_bytes"]),
                    ",".join(t["codecs"])] for key, t in tensors.items()]))
    if values:
        say()
        say(table(["value", "encoding", "value (preview)"],
                  [[key, v["encoding"], v["preview"]] for key, v in values.items()]))
    config = doc.get("config") or {}
    if "config" in config:
        say("\nrun config (recorded by the trainer):")
        say("\n".join("  " + line for line in config_lines(config["config"], CONFIG_LINES)))
    if "model_args" in config:
        say("\nmodel arguments (recorded by the import):")
        say("\n".join("  " + line for line in config_lines({"model": config["model_args"]}, CONFIG_LINES)))
    if not config:
        say("\nno run config recorded (ckpt-convert --to takes --config / --model-args for such a checkpoint)")


def weights(doc: dict, as_json: bool) -> None:
    """A .safetensors file or a Hugging Face directory (:mod:`ckpt.inspect.weights`)."""
    if _emit(doc, as_json):
        return
    totals = doc["totals"]
    kind = "safetensors file" if doc["format"] == "safetensors" else "Hugging Face model directory"
    say(f"{doc['path']}: {kind}, {totals['tensors']} tensors, {totals['elements']:,} elements, "
        f"{human_bytes(totals['bytes'])} ({', '.join(totals['dtypes']) or 'no dtypes'})")
    if doc["format"] == "hf":
        say("config: " + ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}"
                                   for k, v in doc["config"].items()))
        say(f"weights files: {len(doc['weights_files'])}" +
            (f"; not read (pickles): {', '.join(doc['unread'])}" if doc["unread"] else ""))
    elif doc["metadata"]:
        say("metadata: " + ", ".join(f"{k}={v}" for k, v in doc["metadata"].items()))
    if doc["tensors"]:
        hf = doc["format"] == "hf"
        say()
        say(table(["tensor", "dtype", "shape", "size"] + (["file"] if hf else []),
                  [[name, t["dtype"], shape(t["shape"]), human_bytes(t["bytes"])] + ([t["file"]] if hf else [])
                   for name, t in doc["tensors"].items()]))


def _step(side: dict) -> str:
    return f"step {side['step']} ({side['kind']})" if side["step"] is not None else f"{side['path']} ({side['kind']})"


def diff(doc: dict, as_json: bool) -> None:
    """Two checkpoints compared (:func:`ckpt.inspect.diff.diff`)."""
    if _emit(doc, as_json):
        return
    counts = doc["counts"]
    say(f"{_step(doc['a'])} -> {_step(doc['b'])}: {len(doc['added'])} added, {len(doc['removed'])} removed, "
        f"{counts['retyped']} changed dtype/shape, {counts['changed']} changed values, {counts['same']} the same"
        + (f", {counts['unknown']} not compared" if counts["unknown"] else "")
        + f"; {human_bytes(doc['changed_bytes'])} changed")
    for label, keys in (("added", doc["added"]), ("removed", doc["removed"])):
        for key in keys[:SHOWN_DIFF]:
            say(f"  {label:8} {key}")
        if len(keys) > SHOWN_DIFF:
            say(f"  ... and {len(keys) - SHOWN_DIFF} more {label}")
    rows = []
    for key, t in doc["tensors"].items():
        if t["state"] == "retyped":
            rows.append([key, "dtype/shape", f"{t['a']['dtype']} {shape(t['a']['shape'])} -> "
                                             f"{t['b']['dtype']} {shape(t['b']['shape'])}"])
        elif t["state"] == "changed":
            detail = "stored bytes differ (--no-values: not measured)" if t["by"] == "checksums" else \
                f"{t['changed_elements']:,} of {t['elements']:,} elements" + \
                (f", max |diff| {t['max_abs_diff']:.3g}" if "max_abs_diff" in t else "")
            rows.append([key, "values", detail])
    if rows:
        say()
        say(table(["tensor", "changed", "how"], rows[:SHOWN_DIFF]))
        if len(rows) > SHOWN_DIFF:
            say(f"... and {len(rows) - SHOWN_DIFF} more")
    values = doc["values"]
    if any(values.values()):
        say("\nvalues: " + "; ".join(f"{label} {', '.join(keys[:20])}" + (" ..." if len(keys) > 20 else "")
                                      for label, keys in values.items() if keys))
