"""A llama model in the torchtitan style: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Module names follow torchtitan (and so Meta's llama checkpoints, modulo the ``layers.N`` keys)::

    tok_embeddings
    layers.{0..N-1}.attention.{wq,wk,wv,wo}   attention_norm
    layers.{0..N-1}.feed_forward.{w1,w2,w3}   ffn_norm
    layers.{0..N-1}.moe.{router.gate, experts.w{1,2,3}, shared_experts.w{1,2,3}}   (a MoE flavour)
    norm
    output

``layers`` is an ``nn.ModuleDict`` keyed by the layer's global index, so a pipeline stage can delete
the layers it does not own and keep the keys of those it does. A stage may also set
``tok_embeddings``, ``norm`` or ``output`` to ``None``; ``forward`` then passes hidden states through.

The llama-3 family's numerics are explicit arguments: the rotary base (``rope_theta``), llama-3 rotary
frequency scaling (``rope_scaling``, a :class:`RopeScaling`), the norm epsilon, the SwiGLU width
(``ffn_dim``, or the ``multiple_of`` / ``ffn_dim_multiplier`` rounding) and tied embeddings
(``tie_embeddings``: ``output.weight`` is ``tok_embeddings.weight``, one parameter under both keys).

Attention runs through each block's ``attention.core`` (:mod:`trainer.attention`: the whole sequence;
context parallelism swaps in its own, :mod:`trainer.context_parallel`), which also picks the rotary
rows of the positions the rank holds. The rotary tables are non-persistent buffers (not in the
state dict). Building under ``torch.device("meta")`` works; after ``to_empty(device=...)`` call
``init_weights()`` to fill parameters and rotary tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import WHOLE_SEQUENCE, repeat_kv  # noqa: F401 (repeat_kv: part of this module's interface)
from .flavors import BYTE_VOCAB_SIZE, FLAVORS, LLAMA3_FLAVORS, ModelArgs, ffn_hidden_dim, model_args  # noqa: F401
from .flavors import expert_hidden_dim
from .loss import lm_loss
from .moe import MoE
from .rope import apply_rope, rope_tables



# ---------------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.core = WHOLE_SEQUENCE  # context parallelism sets its own (trainer.context_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        cos, sin = self.core.positions(cos, sin, s)  # the full tables come in: under sequence parallelism
        # only the attention input (gathered) knows the sequence length, and context parallelism its positions.
        # -1 rather than the head counts: under tensor parallelism each rank holds a slice of heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.wo(self.core(q, k, v, self.n_rep).reshape(b, s, -1))  # causal (trainer.attention)

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (``hidden`` wide; default: the dense width)."""

    def __init__(self, args: ModelArgs, hidden: int | None = None):
        super().__init__()
        hidden = hidden or ffn_hidden_dim(args)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=out_std)


def build_moe(args: ModelArgs) -> MoE:
    """The block's mixture of experts (:mod:`trainer.moe`), its shared expert one SwiGLU
    ``num_shared_experts`` experts wide."""
    hidden = expert_hidden_dim(args)
    shared = FeedForward(args, hidden * args.num_shared_experts) if args.num_shared_experts else None
    return MoE(args.dim, hidden, args.num_experts, args.top_k, shared)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``; the ffn is ``moe``
    (a mixture of experts) instead of ``feed_forward`` when ``args.num_experts > 0``."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        if args.is_moe:
            self.moe = build_moe(args)
        else:
            self.feed_forward = FeedForward(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + (self.moe if hasattr(self, "moe") else self.feed_forward)(self.ffn_norm(h))

    def init_weights(self) -> None:
        # torchtitan's depth init: output projections of deeper layers start smaller.
        out_std = 0.02 / (2 * (self.layer_id + 1)) ** 0.5
        self.attention.init_weights(out_std)
        (self.moe if hasattr(self, "moe") else self.feed_forward).init_weights(out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, scaling=args.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.loss_chunk_len = 0  # positions per chunk of the chunked loss (trainer.loss); 0: one shot

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens [b, s]`` → ``logits [b, s, vocab]``, or with ``labels [b, s]`` the mean loss
        (:func:`trainer.loss.lm_loss`: chunked by ``loss_chunk_len``; the logits never leave the
        model); a pipeline stage without embedding takes hidden states ``[b, s, dim]``, and one
        without ``output`` returns hidden states (and ignores ``labels``)."""
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.args.max_seq_len}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        if labels is None:
            return self.output(h)
        loss = lm_loss(h, self.output, labels, self.loss_chunk_len)
        return loss + self._moe_aux_loss() if self.args.is_moe else loss

    def _moe_aux_loss(self) -> torch.Tensor:
        """The mean of the blocks' load-balancing losses times ``moe_aux_loss_coef``; the
        unweighted mean is left in ``moe_aux_loss`` (detached) for the metrics."""
        losses = [layer.moe.aux_loss for layer in self.layers.values()]
        mean = torch.stack(losses).mean()
        self.moe_aux_loss = mean.detach()
        return self.args.moe_aux_loss_coef * mean

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter from torch's global RNG and recompute the rotary tables
        (on ``buffer_device``, default: where they are now). Call after ``to_empty`` from meta."""
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = rope_tables(
            self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=device,
            scaling=self.args.rope_scaling,
        )
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight  # to_empty re-creates parameters: tie again
        if self.tok_embeddings is not None and not self.args.tie_embeddings:  # tied: the output's init
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.args.dim ** -0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def build(args: ModelArgs) -> Transformer:
    """A ``Transformer`` on the default device, its weights drawn by ``init_weights`` alone.

    It is constructed on the meta device first, so nn.Linear's default init draws no random numbers:
    ``build`` under ``torch.device("meta")`` then ``to_empty`` + ``init_weights()`` with the same RNG
    state gives the same weights as ``build`` directly.
    """
    device = torch.get_default_device()
    with torch.device("meta"):
        model = Transformer(args)
    if device.type != "meta":
        model.to_empty(device=device)
    model.init_weights()
    return model


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Store ``model``'s parameters in ``dtype`` (bf16 master weights), its buffers (the fp32 rotary
    tables) untouched; before any parallel wrapping."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


# ---------------------------------------------------------------------------------------------------
# Counting


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Parameters of ``model`` (global sizes, also for DTensors and on the meta device)."""
    total = sum(p.numel() for p in model.parameters())
    embedding = getattr(model, "tok_embeddings", None)
    if exclude_embedding and embedding is not None:
        total -= embedding.weight.numel()
    return total


def _non_embedding_params(args: ModelArgs) -> int:
    """What ``num_params(build(args), exclude_embedding=True)`` returns, from the shapes alone (a
    mixture of experts: the parameters one token is computed with, its active parameters)."""
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads)
    feed_forward = 3 * args.dim * ffn_hidden_dim(args)
    if args.is_moe:  # the parameters a token meets: router, its top_k experts, the shared expert
        feed_forward = args.dim * (args.num_experts + 3 * expert_hidden_dim(args) * (args.top_k + args.num_shared_experts))
    norms = 2 * args.dim
    output = 0 if args.tie_embeddings else args.dim * args.vocab_size  # tied: it is the embedding
    return args.n_layers * (attention + feed_forward + norms) + args.dim + output


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token, torchtitan's convention: ``6 N + 12 L H Q T`` with N the
    non-embedding parameters, L layers, H heads, Q head dim, T the sequence length (attention)."""
    return float(6 * _non_embedding_params(args) + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len)
