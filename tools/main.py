"""ckpt: the checkpoint tools as one command (each also installed under its own ``ckpt-*`` name).

    ckpt inspect|merge|convert|replay|copy|prune ARGS...    same arguments as ckpt-inspect, ...
    ckpt --version

``ckpt COMMAND --help`` shows a command's arguments; exit codes are the command's (tools/cli.py).
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

from .cli import command

COMMANDS = {  # name -> (module, what it does)
    "inspect": ("inspection", "list a root's steps, summarise, diff or verify checkpoints; weights files' headers"),
    "merge": ("merge", "one checkpoint's tensors as consolidated .safetensors / torch.save files"),
    "convert": ("convert", "Hugging Face, torch.save, safetensors and DCP checkpoints in and out"),
    "replay": ("replay", "a delta step materialised as a full checkpoint"),
    "copy": ("copy", "committed steps copied to another root, verified, manifest last"),
    "prune": ("prune", "old steps deleted by a retention policy, delta-chain aware"),
}
PROG = "ckpt"


def engine_version() -> str:
    try:
        return version("ckpt-engine")
    except PackageNotFoundError:  # a checkout that was never installed
        return "unknown (not installed)"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} COMMAND [ARGS...]   ({PROG} COMMAND --help for a command's arguments)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "options:", "  --version  the installed ckpt-engine version", "  -h, --help this list"]
    return "\n".join(lines)


@command(PROG)
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"{PROG} {engine_version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"{PROG}: error: unknown command {name!r} (one of: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__package__}.{COMMANDS[name][0]}")
    return module.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
