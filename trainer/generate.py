"""A quick sampler to eyeball a checkpoint without converting it.

    python -m trainer.generate --checkpoint ROOT_OR_STEP [--step N] --prompt TEXT
                               [--max-new-tokens 64] [--temperature 0.8] [--top-k 50] [--seed 0]

The model is rebuilt from what the checkpoint records (its run config, or the model args of an
import: :func:`trainer.hf.run.model_args_of`), only its ``model.`` weights are loaded (verified, as
every load), and the run's tokenizer is used: the built-in byte tokenizer, or the run's
``tokenizer.json`` when it is still there (``--tokenizer`` names another). Sampling is plain
autoregressive decoding on the CPU (or ``--device``), the whole sequence recomputed each token: it is
for looking, not serving. ``--temperature 0`` is greedy. Exit codes: 0 printed, 1 the checkpoint
cannot be read (one line), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

import torch

import ckpt
from ckpt.root import resolve_checkpoint
from .data import load_tokenizer
from .hf.run import model_args_of
from .model import Transformer


def load_model(source: str, step: int | None = None, device: str = "cpu") -> tuple[Transformer, dict, object]:
    """``(model, run config, location)`` of the checkpoint ``source`` names (a step, or a root and
    its newest or ``step``), weights loaded, in eval mode."""
    path = resolve_checkpoint(source, step)
    manifest = ckpt.read_manifest(path)
    args = model_args_of(manifest, path)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights()  # the rotary tables; every weight is then overwritten by the load
    ckpt.load({"model": model}, path, strict=False)
    config = (manifest.user or {}).get("config")
    return model.eval(), config if isinstance(config, dict) else {}, path


def run_tokenizer(config: dict, override: str | None):
    """The tokenizer the run trained with (or ``override``)."""
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    return load_tokenizer(override if override is not None else model.get("tokenizer"))


@torch.no_grad()
def sample(model: Transformer, ids: list[int], *, max_new_tokens: int, temperature: float, top_k: int | None,
           eos_id: int | None, generator: torch.Generator) -> list[int]:
    """``ids`` continued by up to ``max_new_tokens`` sampled tokens (stops at ``eos_id``)."""
    device = next(model.parameters()).device
    tokens = list(ids)
    for _ in range(max_new_tokens):
        window = torch.tensor([tokens[-model.args.max_seq_len:]], device=device)
        logits = model(window)[0, -1].float()
        if temperature <= 0:
            choice = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                cutoff = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            choice = int(torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=generator))
        tokens.append(choice)
        if choice == eos_id:
            break
    return tokens


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoint, or a root holding step-XXXXXXXX checkpoints")
    p.add_argument("--step", type=int, help="with a root: this step (default: the newest committed)")
    p.add_argument("--prompt", default="", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="a tokenizer.json to use instead of the run's")
    p.add_argument("--device", default="cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.max_new_tokens < 0:
        parser().error("--max-new-tokens must not be negative")
    try:
        model, config, _ = load_model(args.checkpoint, args.step, args.device)
        tokenizer = run_tokenizer(config, args.tokenizer)
    except (ckpt.CheckpointError, OSError, ImportError) as exc:
        print(f"trainer.generate: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    prompt = tokenizer.encode(args.prompt, bos=True, eos=False)
    generator = torch.Generator().manual_seed(args.seed)
    tokens = sample(model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_k=args.top_k or None, eos_id=getattr(tokenizer, "eos_id", None), generator=generator)
    print(tokenizer.decode(tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
