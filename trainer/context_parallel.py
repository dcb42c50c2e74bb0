"""Context parallelism: every sequence split over the ``cp`` mesh dimension, attention exact.

Contract: with ``parallelism.cp = C`` each rank of a CP group holds ``seq_len / C`` positions of the
same sequences (the data loader cuts them, :func:`shard_positions`; its state, the global sample
position, does not depend on C). The split is load-balanced for the causal mask (head/tail, as
torchtitan's and Megatron's): the sequence is cut into ``2C`` chunks and rank ``r`` holds chunks ``r``
and ``2C-1-r``, so every rank's queries see the same number of keys. :func:`apply_cp` gives every
attention block a :class:`ContextParallel` core (:mod:`trainer.attention`'s interface):

* rotary positions are the *global* positions of the rank's tokens (rows of the full tables);
* attention all-gathers the keys and values of the CP group (one collective per layer for both,
  before the grouped-query repeat, so only ``kv_heads`` travel), puts them in sequence order and lets
  each of the rank's two chunks attend to the keys up to its own end with the causal mask in global
  positions. The gather's backward is a reduce-scatter of the keys' and values' gradients (a
  functional collective, autograd-aware and traceable), so gradients are exact;
* that mask is given as torch's causal bias aligned to the bottom-right corner
  (``causal_lower_right``: a chunk's ``L`` queries end where its ``start + L`` keys end), not as a
  boolean tensor, which rules out the flash kernel on CUDA and costs an ``L x (start + L)`` tensor
  per chunk and layer. On CUDA torch runs the bias in the flash kernel (whose ``is_causal`` is
  bottom-right aligned) or, where flash does not apply (fp32), the memory-efficient one; elsewhere
  (CPU, NPU: torch's bias dispatch knows only CUDA's kernels) it materialises that same boolean
  mask, so results there are the boolean mask's, bit for bit. torch.compile cannot construct a
  bias (a tensor subclass), only take one in: :func:`apply_cp` has the model make the biases of its
  input's length before its blocks run (a forward pre-hook), so compiled blocks find them made;
* the loss is each rank's mean over its tokens; all ranks hold equally many, and FSDP2 averages the
  gradients over ``dp_shard × cp`` (:mod:`trainer.parallel`), so the step follows the mean over the
  global tokens.

Why all-gather (the Llama-3 paper's choice) rather than ring attention or all-to-all over heads:
it needs no online-softmax merge of partial results (ring attention needs each block's log-sum-exp,
which torch's SDPA does not return on every backend) and no head count divisible by C (all-to-all);
with grouped-query attention the gathered keys/values are ``2 kv_heads / n_heads`` of the queries'
size, and all-gather / reduce-scatter are the two collectives every backend (gloo, NCCL, HCCL) has.
The price is the whole sequence's keys and values on every rank for the layer being computed
(planned by ``--dry-run``, :mod:`trainer.plan.memory`). torch's own
``torch.distributed.tensor.experimental.context_parallel`` (ring attention) is not used: in torch
2.13 it shards only the flash / memory-efficient / cuDNN SDPA kernels, and on a CPU SDPA runs
``_scaled_dot_product_flash_attention_for_cpu``, which has no sharding rule (NotImplementedError).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from .attention import WholeSequence, repeat_kv


class ContextParallelError(ValueError):
    """A sequence length or layout context parallelism cannot split."""


def check_seq_len(seq_len: int, cp: int) -> None:
    """ContextParallelError unless ``seq_len`` splits into ``2 cp`` equal chunks (load balancing)."""
    if cp > 1 and seq_len % (2 * cp):
        raise ContextParallelError(f"training.seq_len = {seq_len} must be divisible by 2 x parallelism.cp = {2 * cp} "
                                   "(each CP rank holds two equal chunks of every sequence)")


def chunks(seq_len: int, cp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two ``[start, end)`` ranges of global positions CP rank ``rank`` holds: chunk ``rank``
    and chunk ``2 cp - 1 - rank`` of ``2 cp``."""
    check_seq_len(seq_len, cp)
    size = seq_len // (2 * cp)
    return (rank * size, (rank + 1) * size), ((2 * cp - 1 - rank) * size, (2 * cp - rank) * size)


def shard_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """The global positions CP rank ``rank`` holds, in the order it holds them (all of them for cp 1)."""
    if cp == 1:
        return list(range(seq_len))
    return [p for start, end in chunks(seq_len, cp, rank) for p in range(start, end)]


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along dim 0, differentiable (backward:
    reduce-scatter of the gradient)."""
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return funcol.wait_tensor(gather(x.contiguous(), 0, group))


class ContextParallel(WholeSequence):
    """The attention core of one CP rank (see the module docstring)."""

    def __init__(self, group, cp: int, rank: int, gather=all_gather):
        self.group, self.cp, self.rank = group, cp, rank
        self.gather = gather  # (x, group) -> every rank's x along dim 0, rank-major (:func:`all_gather`)
        self._cache: dict = {}
        self._biases: dict[int, tuple] = {}  # local length -> the causal bias of each chunk

    def prepare(self, s: int) -> None:
        """Make the causal biases of a local sequence length ``s`` (outside compiled code: see the
        module docstring)."""
        if s not in self._biases:
            # imported here: torch.nn.attention.bias imports torch._dynamo (~1 s of CPU at start-up),
            # which a run without context parallelism never needs (tests/test_import_cost.py)
            from torch.nn.attention.bias import causal_lower_right

            # a bias holds two lengths, no data; under the dry run's modes (FakeTensorMode and the
            # memory tracker, trainer.measure) torch cannot make the subclass, so it is made outside them
            with _disable_current_modes():
                self._biases[s] = tuple(causal_lower_right(end - start, end)
                                        for start, end in chunks(s * self.cp, self.cp, self.rank))

    def _indices(self, s: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's global positions, and the order that puts the gathered (rank-major) rows into
        sequence order, for a local length ``s``."""
        key = (s, str(device))
        if key not in self._cache:
            total = s * self.cp
            mine = torch.tensor(shard_positions(total, self.cp, self.rank), device=device)
            gathered = torch.tensor([p for r in range(self.cp) for p in shard_positions(total, self.cp, r)])
            self._cache[key] = mine, torch.argsort(gathered).to(device)
        return self._cache[key]

    def positions(self, cos: torch.Tensor, sin: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        mine, _ = self._indices(s, cos.device)
        return cos.index_select(0, mine), sin.index_select(0, mine)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int) -> torch.Tensor:
        s = q.shape[1]
        _, order = self._indices(s, q.device)
        kv = torch.stack((k, v)).movedim(2, 0)  # [s, 2, b, kv_heads, d]: one gather for both, sequence first
        kv = self.gather(kv, self.group).index_select(0, order).movedim(0, 2)  # [2, b, S, kv_heads, d]
        keys, values = repeat_kv(kv[0], n_rep).transpose(1, 2), repeat_kv(kv[1], n_rep).transpose(1, 2)
        self.prepare(s)  # made already when the model's forward started; a core called alone makes them here
        outs = []
        for (_, end), local, causal in zip(chunks(s * self.cp, self.cp, self.rank),
                                           (slice(0, s // 2), slice(s // 2, s)), self._biases[s]):
            # queries at global start..end-1 see keys 0..end-1: key j is visible to query i iff
            # j <= start + i, the causal mask of the bottom-right corner (the module docstring)
            outs.append(F.scaled_dot_product_attention(q[:, local].transpose(1, 2), keys[:, :, :end],
                                                       values[:, :, :end], attn_mask=causal))
        return torch.cat(outs, dim=2).transpose(1, 2)


def apply_cp(model: torch.nn.Module, cp_mesh) -> None:
    """Give every attention block of ``model`` a :class:`ContextParallel` core over ``cp_mesh``
    (a 1-D mesh, the ``cp`` dimension); before activation checkpointing and compile wrap the blocks."""
    group, cp, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
    core = ContextParallel(group, cp, rank)
    for block in model.layers.values():
        block.attention.core = core

    def make_biases(module, args, kwargs):
        tokens = args[0] if args else kwargs["tokens"]
        core.prepare(tokens.shape[1])

    model.register_forward_pre_hook(make_biases, with_kwargs=True)

