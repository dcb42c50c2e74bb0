"""The llama model's shapes: :class:`ModelArgs`, the flavour table and how a config overrides it.

Contract: :data:`FLAVORS` maps a flavour name to its :class:`ModelArgs`; :func:`model_args` returns
a flavour with explicit values overriding it; :func:`ffn_hidden_dim` is the SwiGLU width rule.
Nothing here builds a module (:mod:`trainer.model` does). ``num_experts > 0`` makes every block's
feed-forward a mixture of experts (:mod:`trainer.moe`): ``top_k`` routed experts per token out of
``num_experts``, ``num_shared_experts`` always-on SwiGLUs beside them, experts ``moe_ffn_dim`` wide
(None: the dense width), and the router's load-balancing loss weighted by ``moe_aux_loss_coef``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .rope import RopeScaling

BYTE_VOCAB_SIZE = 258  # trainer.data.ByteTokenizer: 256 bytes + BOS + EOS


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: as many as n_heads (plain multi-head attention)
    vocab_size: int = BYTE_VOCAB_SIZE
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    rope_scaling: RopeScaling | None = None  # None: plain rotary frequencies
    tie_embeddings: bool = False  # the output projection is the embedding matrix
    ffn_dim: int | None = None  # the SwiGLU width itself; None: from multiple_of / ffn_dim_multiplier
    num_experts: int = 0  # routed experts per block (trainer.moe); 0: a dense SwiGLU
    top_k: int = 2  # experts each token is routed to
    num_shared_experts: int = 0  # always-on experts beside the routed ones (one SwiGLU that much wider)
    moe_ffn_dim: int | None = None  # one expert's SwiGLU width; None: ffn_hidden_dim
    moe_aux_loss_coef: float = 0.01  # weight of the router's load-balancing loss in the training loss

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # ModelArgs(**dataclasses.asdict(args)) round-trips
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.ffn_dim is not None and self.ffn_dim < 1:
            raise ValueError(f"ffn_dim {self.ffn_dim} must be >= 1")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"norm_eps {self.norm_eps} and rope_theta {self.rope_theta} must be > 0")
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.top_k <= self.num_experts):
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts {self.num_experts}]")
        if self.num_shared_experts < 0 or self.moe_aux_loss_coef < 0:
            raise ValueError("num_shared_experts and moe_aux_loss_coef must be >= 0")
        if self.moe_ffn_dim is not None and self.moe_ffn_dim < 1:
            raise ValueError(f"moe_ffn_dim {self.moe_ffn_dim} must be >= 1")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.kv_heads}; "
                "set n_kv_heads to a divisor of n_heads"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


# Llama-3's rotary numerics (torchtitan's llama3 flavors: theta 500000, llama scaling with its defaults).
_LLAMA3 = dict(rope_theta=500000.0, rope_scaling=RopeScaling(), max_seq_len=8192)

FLAVORS: dict[str, ModelArgs] = {
    # ~0.85M parameters: trains in seconds on a CPU.
    "debug": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=64),
    # ~25M parameters: a bigger CPU / single-device model.
    "small": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, multiple_of=256),
    # Llama-2 shapes.
    "7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, max_seq_len=4096),
    "13b": ModelArgs(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, max_seq_len=4096),
    "70b": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
        ffn_dim_multiplier=1.3, multiple_of=4096, max_seq_len=4096,
    ),
    # Mixture of experts (trainer.moe), Mixtral-shaped: 8 experts, 2 per token. ~1.8M parameters.
    "moe_debug": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=64, num_experts=8, top_k=2,
                           moe_ffn_dim=128),
    # ~92M parameters (~37M active per token), one shared expert beside the routed ones.
    "moe_small": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, num_experts=8, top_k=2, moe_ffn_dim=768,
                           num_shared_experts=1),
    # torchtitan's llama3 "debugmodel" (its vocabulary 2048 is replaced by the tokenizer's).
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, multiple_of=256,
                            **_LLAMA3),
    # Llama-3.x shapes (torchtitan's llama3 flavors 1B, 3B, 8B, 70B; the 1B and 3B tie embeddings).
    "llama3-1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                           ffn_dim_multiplier=1.5, tie_embeddings=True, **_LLAMA3),
    "llama3-3b": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                           ffn_dim_multiplier=1.0, tie_embeddings=True, **_LLAMA3),
    "llama3-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                           ffn_dim_multiplier=1.3, **_LLAMA3),
    "llama3-70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                            ffn_dim_multiplier=1.3, **_LLAMA3),
}
LLAMA3_FLAVORS = {"debugmodel": "debugmodel", "1b": "llama3-1b", "3b": "llama3-3b", "8b": "llama3-8b",
                  "70b": "llama3-70b"}
"""torchtitan's llama3 flavor names -> ours (``model.name = "llama3"`` looks flavors up here)."""


def model_args(
    flavor: str,
    *,
    vocab_size: int | None = None,
    dim: int | None = None,
    n_layers: int | None = None,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    max_seq_len: int | None = None,
    **numerics,
) -> ModelArgs:
    """The flavor's ``ModelArgs`` (name case-insensitive), with any explicit value overriding it:
    the shapes above, and any other ``ModelArgs`` field by name (``rope_theta``, ``rope_scaling``,
    ``norm_eps``, ``tie_embeddings``, ``ffn_dim``, ``multiple_of``, ``ffn_dim_multiplier``; None
    keeps the flavor's). ``rope_scaling=False`` removes the flavor's scaling."""
    key = flavor.lower()
    if key not in FLAVORS:
        raise ValueError(f"unknown model flavor {flavor!r}; known flavors: {', '.join(FLAVORS)}")
    overrides = dict(
        vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, max_seq_len=max_seq_len, **numerics,
    )
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.get("rope_scaling") is False:
        given["rope_scaling"] = None
    if "multiple_of" in given or "ffn_dim_multiplier" in given:
        given.setdefault("ffn_dim", None)  # a rounding given replaces the flavor's fixed width
    return dataclasses.replace(FLAVORS[key], **given)


def expert_hidden_dim(args: ModelArgs) -> int:
    """One expert's SwiGLU width: ``moe_ffn_dim``, else the dense width."""
    return args.moe_ffn_dim if args.moe_ffn_dim is not None else ffn_hidden_dim(args)


def ffn_hidden_dim(args: ModelArgs) -> int:
    """Llama's SwiGLU width: ``ffn_dim`` when given, else 2/3 of 4*dim, times the multiplier,
    rounded up to ``multiple_of``."""
    if args.ffn_dim is not None:
        return args.ffn_dim
    hidden = int(2 * (4 * args.dim) / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * math.ceil(hidden / args.multiple_of)
