"""The dry-run plan: memory per rank and the checkpoint a configuration needs, before anything runs.

    python -m trainer.plan --config FILE [--world-size N] [--device-memory GIB|NAME]
                           [--storage-gbps X] [--storage-shared] [--json] [--section.key value ...]

No process group, no device, no tensor: the model is built on the meta device (shapes only, instant
for 70B) and every figure is arithmetic on its parameters' shapes, the layout and the batch.

Flags (everything else is the trainer's configuration, read by :func:`trainer.config.load_config`):

  --world-size N         ranks to plan for; default: $WORLD_SIZE, else the product of the degrees
                         when dp_shard is given, else 1 (a plain ``python -m trainer.train``)
  --device-memory G|NAME memory of one device in GiB, or a device of :data:`KNOWN_DEVICES` (e.g.
                         H100); default: the Ascend 910B for training.device = npu, otherwise the
                         verdict is given for every known device
  --storage-gbps X       GB/s (10^9 bytes) one rank can write to the checkpoint storage (default 2)
  --storage-shared       the ranks share one link of that speed (time = whole checkpoint / X);
                         default: each rank has its own (time = the largest rank's share / X)
  --json                 the plan as JSON (:meth:`Plan.to_dict`)

Exit codes (:mod:`trainer.exits`): 0 with the plan on stdout (also when it does not fit: that is a
finding, not an error); 2 and one ``error: ...`` line on stderr for a configuration or layout that
cannot work (degrees vs the world size, heads not divisible by tp, fewer layers than stages, DDP
with dp_replicate > 1, tp or pp, cpu_offload without FSDP2, an unreadable file, a bad flag). What
the trainer would refuse later but does not stop the arithmetic (a batch that does not add up,
gradient accumulation with a pipeline) is listed under problems in the plan.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from . import checkpoint
from . import memory
from .. import exits
from ..config import Config, ConfigError, load_config
from .build import plan
from .report import format_plan

HELP = "\n".join((__doc__, memory.__doc__, checkpoint.__doc__))
"""``--help``: how to run it, then what each figure counts (the memory and checkpoint modules' own words)."""

_FLAGS = {"--world-size": int, "--device-memory": str, "--storage-gbps": float, "--storage-shared": bool,
          "--json": bool}


def split_flags(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(this module's flags, the rest for :func:`trainer.config.load_config`)."""
    own: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        name, eq, value = arg.partition("=")
        kind = _FLAGS.get(name)
        if kind is None:
            rest.append(arg)
            continue
        if kind is bool:
            if eq:
                raise ConfigError(f"{name} takes no value")
            own[name] = True
            continue
        if not eq:
            if i >= len(argv):
                raise ConfigError(f"{name} needs a value")
            value, i = argv[i], i + 1
        try:
            own[name] = kind(value)
        except ValueError:
            raise ConfigError(f"{name} expects {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    return own, rest


def _default_world(cfg: Config, notes: list[str]) -> int:
    env = os.environ.get("WORLD_SIZE")
    if env and env.isdigit():
        notes.append(f"world size {env} from $WORLD_SIZE")
        return int(env)
    p = cfg.parallelism
    others = p.dp_replicate * p.tp * p.pp * getattr(p, "cp", 1)
    if p.dp_shard != -1:
        return others * p.dp_shard
    notes.append(f"world size {others}: parallelism.dp_shard = -1 fills whatever --world-size gives "
                 "(none given: the other degrees' product)")
    return others


def world_size(cfg: Config, own: dict[str, Any], notes: list[str]) -> int:
    """``--world-size``, else the default (a note in ``notes`` says where it came from)."""
    return own["--world-size"] if "--world-size" in own else _default_world(cfg, notes)


def source_of(rest: list[str]) -> str | None:
    """The ``--config`` file named in the configuration arguments."""
    source = None
    for i, arg in enumerate(rest):
        if arg == "--config" and i + 1 < len(rest):
            source = rest[i + 1]
        elif arg.startswith("--config="):
            source = arg.partition("=")[2]
    return source


def plan_options(own: dict[str, Any]) -> dict[str, Any]:
    """:func:`trainer.plan.plan`'s keyword arguments from this module's flags."""
    memory, device = own.get("--device-memory"), None
    if memory is not None:
        try:
            memory = float(memory)
        except ValueError:
            memory, device = None, own["--device-memory"]
    return {"device_memory_gib": memory, "device": device, "storage_gbps": own.get("--storage-gbps", 2.0),
            "storage_shared": own.get("--storage-shared", False)}


def _run(argv: list[str]) -> None:
    own, rest = split_flags(argv)
    cfg = load_config(rest)
    notes: list[str] = []
    result = plan(cfg, world_size(cfg, own, notes), **plan_options(own), source=source_of(rest))
    result.notes[:0] = notes
    print(json.dumps(result.to_dict(), indent=2) if own.get("--json") else format_plan(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (0 with a plan, 2 for what cannot work)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(HELP)
        return exits.DONE
    return exits.run(lambda: _run(argv))
