"""What one layer, the model's head and the inputs save for backward, per microbatch, in bytes.

Contract: pure arithmetic on :class:`~trainer.model.ModelArgs`, the tp degree and a microbatch of
``b`` sequences of ``s`` tokens; the formulas, and what they count, are in
:mod:`trainer.plan.memory`'s docstring. :class:`Numerics` says how many bytes each saved tensor
takes in a precision under a wrapping (:func:`numerics`). Checked against the saved tensors of a
real block in tests/trainer/plan/test_build.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import ModelArgs, ffn_hidden_dim

@dataclass(frozen=True)
class Numerics:
    """Bytes per element of what the block saves (see :mod:`trainer.plan.memory`)."""

    name: str
    e: int  # projections' outputs, attention, SwiGLU
    e_norm: int  # normalised values saved by the norm's weight multiply
    e_input: int  # a block's input (what activation checkpointing keeps)
    gathered_inputs: int  # copies of the projections' inputs saved
    e_param: int  # compute copies of parameters


def numerics(precision: str, wrap: str) -> Numerics:
    """What saves what in ``precision`` (fp32, or bf16/fp16: mixed) under ``wrap`` (fsdp, ddp, none)."""
    if precision == "fp32":
        return Numerics("fp32", 4, 4, 4, 2, 4)
    if wrap == "fsdp":
        return Numerics(f"{precision} (FSDP2 mixed precision)", 2, 2, 2, 2, 2)
    return Numerics(f"{precision} (autocast)", 2, 4, 4, 5, 2)


def layer_activation_bytes(args: ModelArgs, num: Numerics, tp: int, b: int, s: int) -> int:
    """Bytes one layer saves for backward for one microbatch of ``b`` sequences of ``s`` tokens."""
    h, a, f = args.dim, args.n_heads // tp, -(-ffn_hidden_dim(args) // tp)
    s_t = -(-s // tp)
    # k and v reach attention repeated to every query head (a copy), unless a rank has one kv head:
    # then the repeat is a stride-0 view of it.
    kv = 1 if args.kv_heads // tp == 1 else a
    along_sequence = b * s_t * (8 * h + 2 * num.e_norm * h + 8)
    gathered = b * s * num.gathered_inputs * num.e * h
    split = b * s * (num.e * args.head_dim * (2 * a + 2 * kv) + 4 * a + 4 * num.e * f)
    return along_sequence + gathered + split


def cp_gathered_bytes(args: ModelArgs, num: Numerics, tp: int, b: int, s: int, cp: int) -> int:
    """What a layer saves under context parallelism beyond :func:`layer_activation_bytes` of its
    ``s / cp`` local positions (``s``: the whole sequence): attention keeps the keys and values of the
    whole sequence gathered from the CP group (repeated to every query head, unless a rank has one kv
    head), instead of its own, and the causal masks of its two chunks, ``(2 cp + 1) L²`` elements
    with ``L = s / (2 cp)`` (SDPA keeps them as an additive mask in the compute dtype)."""
    if cp == 1:
        return 0
    a = args.n_heads // tp
    kv = 1 if args.kv_heads // tp == 1 else a
    chunk = s // (2 * cp)
    return b * (s - s // cp) * num.e * args.head_dim * 2 * kv + num.e * (2 * cp + 1) * chunk * chunk


def layer_input_bytes(args: ModelArgs, num: Numerics, tp: int, b: int, s: int) -> int:
    """What a layer keeps under activation checkpointing: its input."""
    return b * -(-s // tp) * num.e_input * args.dim


def layer_op_level_bytes(args: ModelArgs, num: Numerics, tp: int, b: int, s: int) -> int:
    """What a layer keeps under selective op-level checkpointing (optimization.ac_op_level): its
    input plus the outputs of its matmuls and of attention (q, k, v, wo, w1, w3, w2; output and
    log-sum-exp); wo's and w2's local outputs are whole-sequence partial sums before their
    reduce-scatter, so not divided by tp."""
    a, kv, f = args.n_heads // tp, args.kv_heads // tp, -(-ffn_hidden_dim(args) // tp)
    hd = args.head_dim
    outputs = num.e * (2 * a * hd + 2 * kv * hd + 2 * f + 2 * args.dim) + 4 * a
    return layer_input_bytes(args, num, tp, b, s) + b * s * outputs


def head_activation_bytes(args: ModelArgs, num: Numerics, tp: int, b: int, s: int, *,
                          loss_parallel: bool = False, chunk_len: int = 0) -> int:
    """The last stage's final norm, the output's gathered input and the loss (logits, log-softmax,
    its gradient), for one microbatch: the logits of ``V/tp`` vocabulary entries per token under
    loss parallel, else all ``V``; of one chunk of ``chunk_len`` positions under the chunked loss
    (trainer.loss), else of the whole sequence."""
    h = args.dim
    norm = b * -(-s // tp) * (4 * h + num.e_norm * h + 4)
    output_input = b * s * num.e * h
    vocab = -(-args.vocab_size // tp) if loss_parallel and tp > 1 else args.vocab_size
    positions = min(s, chunk_len) if chunk_len > 0 else s
    loss = b * positions * (num.e + 8) * vocab
    return norm + output_input + loss


def korthikanti_layer_bytes(args: ModelArgs, tp: int, b: int, s: int) -> int:
    """Korthikanti et al. (2022), half precision, full attention storage, sequence parallel."""
    return int(s * b * args.dim * (34 + 5 * args.n_heads * s / args.dim) / tp)
