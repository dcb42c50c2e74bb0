"""Context parallelism (trainer.context_parallel): the load-balanced split, the loader's CP slices,
the config keys, the attention core of every CP rank in one process (a stand-in gather: the causal
bias gives the boolean mask's results bit for bit, and the whole sequence's; compiled blocks take
it whole); and, on spawned gloo ranks, loss parity of CP 2 (FSDP2, DDP), FSDP 2 x CP 2 and CP 2 x
TP 2 with one process, and a run saved at CP 2 resumed at CP 1 (bitwise state after the reshard)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tests.support import models
from tests.support.launch import run_ranks
from tests.support.trainer_runs import run_trainer, trainer_args
from trainer.config import ConfigError, load_config
from trainer.attention import WHOLE_SEQUENCE
from trainer.context_parallel import ContextParallel, ContextParallelError, apply_cp, chunks, shard_positions
from trainer.data import DataLoader
from trainer.flavors import ModelArgs
from trainer.model import build
from trainer.parallel import ParallelDims, ParallelismError, apply_compile

STEPS = 4
TOLERANCE = 1e-5  # absolute, on losses near 5.5 (fp32; reassociation only); measured: see _close's callers
SAVE_AT_2 = {"checkpoint__enable": "true", "checkpoint__interval": 2}


def test_split_is_head_tail_and_covers_the_sequence():
    assert chunks(16, 2, 0) == ((0, 4), (12, 16)) and chunks(16, 2, 1) == ((4, 8), (8, 12))
    for cp in (1, 2, 4):
        held = [p for r in range(cp) for p in shard_positions(16, cp, r)]
        assert sorted(held) == list(range(16))
    with pytest.raises(ContextParallelError, match="divisible by 2 x parallelism.cp"):
        chunks(18, 2, 0)


def test_loader_gives_each_cp_rank_its_columns_and_keeps_its_state():
    tokens = np.arange(2000, dtype=np.int32)
    whole = DataLoader(tokens, 16, 4, seed=3)
    parts = [DataLoader(tokens, 16, 4, seed=3, cp_rank=r, cp_degree=2) for r in range(2)]
    for _ in range(3):
        inputs, labels = whole.next_batch()
        for rank, part in enumerate(parts):
            cols = shard_positions(16, 2, rank)
            got_in, got_labels = part.next_batch()
            assert torch.equal(got_in, inputs[:, cols]) and torch.equal(got_labels, labels[:, cols])
    assert all(part.state_dict() == whole.state_dict() for part in parts)


def test_config_keys_and_refusals():
    assert load_config(["--distributed.cp_size", "2"]).parallelism.cp == 2
    with pytest.raises(ConfigError, match="parallelism.cp=2 is invalid: needs training.seq_len"):
        load_config(["--parallelism.cp", "2", "--training.seq_len", "66"])
    with pytest.raises(ConfigError, match="parallelism.cp=2 is invalid: is not supported with parallelism.pp"):
        load_config(["--parallelism.cp", "2", "--parallelism.pp", "2"])
    dims = ParallelDims.resolve(1, -1, 2, 1, 8, cp=2)
    assert (dims.dp_shard, dims.dp, dims.dp_cp) == (2, 2, 4)
    with pytest.raises(ParallelismError, match=r"cp\(2\)"):
        ParallelDims.resolve(1, 3, 1, 1, 8, cp=2)


def test_dry_run_divides_activations_by_cp_and_adds_the_gathered_keys_values():
    from tests.support import REPO
    from trainer.plan import plan

    base = ["--config", str(REPO / "configs" / "debug.toml"), "--training.seq_len", "1024"]
    one = plan(load_config(base), 1).stages[0].memory["activations"]
    cp2 = plan(load_config([*base, "--parallelism.cp", "2"]), 2)
    assert 0.5 * one < cp2.stages[0].memory["activations"] < 0.6 * one
    assert cp2.layout["cp"] == 2 and "dp_shard 1 x cp 2" in cp2.layout["data_parallel"]


# ---------------------------------------------------------------------------------------------------
# The attention core, every CP rank in one process

BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 8  # grouped-query: every kv head serves 2 query heads


class _Sdpa(TorchFunctionMode):
    """Records the inputs, ``attn_mask`` and output of each SDPA call the core makes (torch's calls
    inside one, such as the causal bias's materialised mask on CPU, run with the mode off)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention:
            self.calls.append((args[:3], (kwargs or {}).get("attn_mask"), out))
        return out


def _cp_outputs(cp: int, seq_len: int, q, k, v) -> torch.Tensor:
    """The CP core's output of every rank, put back in sequence order; the gather is a stand-in that
    returns every rank's keys and values, rank-major, as the collective does."""
    shards = [shard_positions(seq_len, cp, r) for r in range(cp)]
    kv_of = [torch.stack((k[:, cols], v[:, cols])).movedim(2, 0) for cols in shards]
    out = torch.empty_like(q)
    for rank, cols in enumerate(shards):
        core = ContextParallel(None, cp, rank, gather=lambda x, group: torch.cat(kv_of))
        out[:, cols] = core(q[:, cols], k[:, cols], v[:, cols], HEADS // KV_HEADS)
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_core_passes_a_causal_bias_that_gives_the_boolean_masks_results_bit_for_bit(cp):
    """Every chunk's attention gets torch's bottom-right causal bias, never a boolean tensor (which
    rules out the flash and NPU fused kernels); on CPU it computes what the boolean mask of global
    positions computed, bit for bit, forward and backward; the ranks together give the whole
    sequence's causal attention."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    seq_len = 8 * cp
    torch.manual_seed(cp)
    q = torch.randn(BATCH, seq_len, HEADS, HEAD_DIM)
    k, v = (torch.randn(BATCH, seq_len, KV_HEADS, HEAD_DIM) for _ in range(2))
    with _Sdpa() as sdpa:
        out = _cp_outputs(cp, seq_len, q, k, v)
    assert len(sdpa.calls) == 2 * cp  # two chunks per rank
    for (query, key, value), bias, got in sdpa.calls:
        assert isinstance(bias, CausalBias) and bias.variant == CausalVariant.LOWER_RIGHT, type(bias)
        length, keys = query.shape[2], key.shape[2]
        assert (bias.seq_len_q, bias.seq_len_kv) == (length, keys)
        # the boolean mask in global positions: the chunk's queries start at keys - length
        mask = torch.ones(length, keys, dtype=torch.bool).tril(diagonal=keys - length)
        leaves = [t.detach().clone().requires_grad_() for t in (query, key, value)]
        with_bias = F.scaled_dot_product_attention(*leaves, attn_mask=bias)
        with_mask = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
        assert torch.equal(got, with_mask) and torch.equal(with_bias, with_mask)
        grad = torch.randn_like(with_mask)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(with_bias, leaves, grad),
                                                      torch.autograd.grad(with_mask, leaves, grad)))
    whole = WHOLE_SEQUENCE(q, k, v, HEADS // KV_HEADS)
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-6)


def test_cp_blocks_compile_whole_graphs(monkeypatch):
    """torch.compile cannot construct a causal bias inside a block (a tensor subclass); the model
    makes them when its forward starts (apply_cp's pre-hook), so compiled blocks run without a graph
    break (fullgraph) and give the eager model's loss and gradients. One CP rank of 2; the stand-in
    gather repeats the rank's keys and values (the shapes of the collective's, not its values)."""
    mesh = SimpleNamespace(get_group=lambda: None, size=lambda: 2, get_local_rank=lambda: 0)
    tokens, labels = torch.randint(0, 64, (2, 2, 8)).unbind(0)
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build(ModelArgs(dim=32, n_layers=2, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=64,
                                multiple_of=16, max_seq_len=32))
        apply_cp(model, mesh)
        model.layers["0"].attention.core.gather = lambda x, group: torch.cat([x, x])
        if compiled:
            monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
            apply_compile(model)
        loss = model(tokens, labels)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (eager, eager_grads), (compiled, compiled_grads) = results
    assert torch.equal(compiled, eager) and all(map(torch.equal, compiled_grads, eager_grads))


# ---------------------------------------------------------------------------------------------------
# Spawned ranks (slow)

FOUR_RANKS = {
    "fsdp2xcp2": {"parallelism__cp": 2, "parallelism__dp_shard": 2},
    "cp2xtp2": {"parallelism__cp": 2, "parallelism__tp": 2},
}


def _resume_at_2(root, name: str) -> dict:
    """Continue the run ``name`` from its step-2 checkpoint, in another job folder."""
    return {"checkpoint__enable": "true", "checkpoint__interval": 2, "checkpoint__load_step": 2,
            "checkpoint__branch": "true", "checkpoint__folder": f"{root}/{name}/checkpoints"}


def _loaded_then_trained(argv: list[str]):
    """The full state right after the resume, then the losses of the steps that follow."""
    from trainer.train import Trainer

    trainer = Trainer(load_config(argv))
    try:
        loaded = models.full_state(trainer.model, trainer.optimizer)
        return loaded, trainer.fit()
    finally:
        trainer.close()


def _four(rank: int, world: int, root: str) -> dict:
    return {name: run_trainer(trainer_args(f"{root}/{name}", steps=STEPS, **layout))[0]
            for name, layout in FOUR_RANKS.items()}


def _two(rank: int, world: int, root: str) -> dict:
    out = {"cp2": run_trainer(trainer_args(f"{root}/cp2", steps=STEPS, parallelism__cp=2, **SAVE_AT_2))[0],
           "cp2-ddp": run_trainer(trainer_args(f"{root}/cp2-ddp", steps=STEPS, parallelism__cp=2,
                                               optimization__zero_stage=0))[0]}
    # the step-2 checkpoint of the CP 2 run, loaded at CP 2: what the one-process resume must hold
    argv = trainer_args(f"{root}/cp2-loaded", steps=STEPS, parallelism__cp=2, **_resume_at_2(root, "cp2"))
    out["cp2-state-at-2"] = run_trainer(argv, stop_at=2)[1]
    return out


def _close(losses: list[float], reference: list[float]) -> float:
    diff = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    assert diff < TOLERANCE, (losses, reference)
    print(f"max |loss - one process| = {diff:.1e}")  # what TOLERANCE's comment quotes (pytest -s)
    return diff


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.slow
def test_cp_layouts_match_one_process_and_resume_at_cp1(tmp_path):
    """CP 2 (FSDP2 and DDP over the CP ranks), FSDP 2 x CP 2 and CP 2 x TP 2 train as one process does (fp32, within TOLERANCE); the
    step-2 checkpoint of CP 2 loads into one process with the same model and optimizer state, bit for
    bit, and the losses continue as the one-process run's."""
    root = str(tmp_path)
    reference = run_trainer(trainer_args(f"{root}/reference", steps=STEPS))[0]
    two = run_ranks(2, _two, root)[0]
    _close(two["cp2"], reference)
    _close(two["cp2-ddp"], reference)
    four = run_ranks(4, _four, root)[0]
    for name in FOUR_RANKS:
        _close(four[name], reference)
    loaded, losses = _loaded_then_trained(trainer_args(f"{root}/cp1-from-cp2", steps=STEPS, **_resume_at_2(root, "cp2")))
    assert _equal(loaded, two["cp2-state-at-2"])
    _close(losses, reference[2:])
