"""trainer.plan.plan (trainer/plan/build.py and the rooms it puts together), the dry run: parameter
counts, per-rank bytes for FSDP/TP/PP layouts computed by hand from ModelArgs, the activation formula
against what autograd really saves, the seed's 70B file on 64 ranks without allocating, the verdict.
The command line is tests/trainer/plan/test_cli.py. Fast: single process, meta-device models."""

from __future__ import annotations

import math
import resource

import pytest
import torch

from trainer import plan as plan_mod
from trainer.config import load_config
from trainer.model import FLAVORS, ModelArgs, TransformerBlock, model_args
from trainer.rope import rope_tables
from trainer.plan import GIB, KNOWN_DEVICES, format_plan, main, plan
from tests.support import REPO as ROOT
from trainer.plan import memory as plan_memory
from trainer.plan import params as plan_params

DEBUG = str(ROOT / "configs" / "debug.toml")
SEED_70B = str(ROOT / "configs" / "seed_70b.yaml")


def cfg(*argv: str, config: str = DEBUG):
    return load_config(["--config", config, *argv])


# ---------------------------------------------------------------------------------------------------
# Parameters, from the ModelArgs formulas (written out here, not taken from trainer.model)


def swiglu(a: ModelArgs) -> int:
    hidden = int(2 * 4 * a.dim / 3)
    if a.ffn_dim_multiplier is not None:
        hidden = int(a.ffn_dim_multiplier * hidden)
    return a.multiple_of * math.ceil(hidden / a.multiple_of)


def counts(a: ModelArgs) -> dict[str, int]:
    hd, kv = a.dim // a.n_heads, a.n_kv_heads or a.n_heads
    return {
        "embedding": a.vocab_size * a.dim,
        "wq": a.dim * a.n_heads * hd, "wk": a.dim * kv * hd, "wv": a.dim * kv * hd, "wo": a.n_heads * hd * a.dim,
        "w1": a.dim * swiglu(a), "w2": swiglu(a) * a.dim, "w3": a.dim * swiglu(a),
        "layer_norms": 2 * a.dim, "norm": a.dim, "output": a.dim * a.vocab_size,
    }


def layer(c: dict[str, int]) -> int:
    return sum(c[k] for k in ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "layer_norms"))


def total(a: ModelArgs) -> int:
    c = counts(a)
    return c["embedding"] + a.n_layers * layer(c) + c["norm"] + c["output"]


@pytest.mark.parametrize("flavor, expected", [
    ("7b", 6_738_415_616), ("13b", 13_015_864_320), ("70b", 68_976_648_192)])
def test_llama2_flavors_have_the_published_parameter_counts(flavor, expected):
    # Meta's Llama-2 checkpoints (vocabulary 32000): 6.74B, 13.0B, 68.98B.
    assert total(FLAVORS[flavor]) == expected
    p = plan(cfg(f"--model.flavor={flavor}", "--model.vocab_size=32000", "--training.seq_len=4096"), 8)
    assert p.model["params"] == expected == p.model["llama2_reference"] == plan_mod.LLAMA2_PARAMS[flavor]
    assert sum(p.model["params_by_module"].values()) == expected
    assert not any("not Llama-2" in n for n in p.notes)


def test_a_flavor_with_the_byte_vocabulary_is_reported_not_fudged():
    p = plan(cfg("--model.flavor=70B"), 8)  # no vocab_size: the byte tokenizer's 258, as the trainer does
    assert p.model["params"] == total(model_args("70b", vocab_size=258)) == 68_976_648_192 - 2 * 8192 * (32000 - 258)
    assert any("vocab_size 258 instead of 32000" in n for n in p.notes)


def debug_args() -> ModelArgs:
    a = model_args("debug")
    assert (a.dim, a.n_layers, a.n_heads, a.kv_heads, a.vocab_size, swiglu(a)) == (128, 4, 4, 2, 258, 384)
    return a


def test_fsdp2_two_ranks_by_hand():
    a, c = debug_args(), counts(debug_args())
    n = total(a)
    p = plan(cfg(), 2)  # debug.toml: fp32, zero_stage 3, dp_shard -1
    assert p.layout["dp_shard"] == 2 and p.layout["wrap"] == "fsdp"
    (st,) = p.stages
    assert st.params_local == n == 853_632
    assert st.params == n // 2  # every dim 0 is even: 258, 128, 64, 384
    m = st.memory
    half = n // 2
    assert (m["params"], m["step_grads"], m["optimizer"], m["optimizer_step"]) == (4 * half, 4 * half, 8 * half, 4 * half)
    # One micro-step: no gradient is held from an earlier one; backward starts with the root's
    # (FSDP2 reduces it at the end) norm and output gradients, in the compute dtype (fp32 here).
    assert m["grads"] == 0 and m["head_grads"] == 4 * (c["norm"] + c["output"])
    root = c["embedding"] + c["norm"] + c["output"]
    assert m["compute_params"] == 4 * (root + 2 * layer(c))  # zero 3: root unsharded + current and next layer
    assert m["reduce_scatter"] == (4 + 4) * layer(c)  # the largest FSDP unit: a layer (196864 > 66176)
    assert m["grad_accumulation"] == 0 and m["ddp_buckets"] == 0  # one micro-step per step
    assert m["buffers"] == 2 * 4 * a.max_seq_len * (a.dim // a.n_heads) // 2  # RoPE cos + sin, fp32
    assert m["stage_outputs"] == 0  # no pipeline
    b, s = 4, 128  # batch 8 over dp 2, one micro-step
    assert p.batch["micro_batch_size"] == b and p.batch["gradient_accumulation_steps"] == 1
    h, f, heads = a.dim, swiglu(a), a.n_heads
    per_layer = b * s * (40 * h + 16 * f + 8 + 4 * heads)  # fp32, tp 1
    assert m["activations"] == a.n_layers * per_layer + 8 * b * s and m["recompute"] == 0
    persistent = 12 * (n // 2) + m["buffers"]  # fp32 masters, AdamW's moments; the gradients are not there all step
    transient = sum(v for k, v in m.items() if k not in ("params", "optimizer", "buffers", "step_grads", "optimizer_step"))
    assert transient > m["step_grads"] + m["optimizer_step"]
    assert st.peak == persistent + transient
    # The checkpoint: 12 bytes per parameter + 4 per AdamW step counter + the small state, split in two.
    tensors = 2 + 9 * a.n_layers + 1
    assert p.checkpoint["unique_bytes"] == 12 * n + 4 * tensors + plan_mod.SMALL_STATE_BYTES
    assert st.checkpoint_write == 12 * n // 2 + 4 * tensors + plan_mod.SMALL_STATE_BYTES


def test_tensor_parallel_two_ranks_by_hand():
    c = counts(debug_args())
    p = plan(cfg("--parallelism.tp=2"), 2)
    assert p.layout["wrap"] == "none"  # dp 1: the model is not wrapped
    (st,) = p.stages
    norms = 4 * c["layer_norms"] + c["norm"]
    split = (c["embedding"] // 2 + 4 * (c["wq"] + c["wk"] + c["wv"] + c["wo"] + c["w1"] + c["w2"] + c["w3"]) // 2
             + c["output"] // 2)
    assert st.params_local == st.params == split + norms == 427_392
    assert st.memory["params"] == 4 * 427_392 and st.memory["compute_params"] == 0  # fp32, no FSDP
    # bf16 without FSDP runs under autocast: its cache holds a bf16 copy of every Linear weight.
    bf16 = plan(cfg("--parallelism.tp=2", "--optimization.precision=bf16"), 2).stages[0]
    linear = 4 * (c["wq"] + c["wk"] + c["wv"] + c["wo"] + c["w1"] + c["w2"] + c["w3"]) // 2 + c["output"] // 2
    assert bf16.memory["compute_params"] == 2 * linear


def test_pipeline_two_stages_by_hand():
    a, c = debug_args(), counts(debug_args())
    p = plan(cfg("--parallelism.pp=2"), 2)  # batch 8 on one data-parallel rank: 2 microbatches (pp) of 4
    assert not p.problems
    first, last = p.stages
    assert (first.layers, last.layers) == ([0, 1], [2, 3])
    assert (first.holds, last.holds) == (["embedding"], ["norm + output"])
    assert first.params == c["embedding"] + 2 * layer(c) == 426_752
    assert last.params == 2 * layer(c) + c["norm"] + c["output"] == 426_880
    assert first.params + last.params == total(a)
    assert first.memory["params"] == 4 * 426_752 and last.memory["optimizer"] == 8 * 426_880
    # 1F1B with 2 microbatches: stage 0 holds both, the last one.
    assert p.batch["pipeline_microbatches"] == 2 and (first.in_flight, last.in_flight) == (2, 1)
    b, s = p.batch["pipeline_microbatch_size"], 128
    assert b == 4
    per_layer = b * s * (40 * a.dim + 16 * swiglu(a) + 8 + 4 * a.n_heads)
    assert first.memory["activations"] == 2 * (2 * per_layer + 8 * b * s)
    assert last.memory["activations"] == 1 * (2 * per_layer)
    assert last.memory["loss"] > 0 == first.memory["loss"]
    # Stage 0 keeps what it sent for each in-flight microbatch (fp32 hidden states) until its backward.
    assert first.memory["stage_outputs"] == 2 * b * s * a.dim * 4 and last.memory["stage_outputs"] == 0
    assert [r["name"] for r in p.roles] == ["first stage (0)", "last stage (1)"]


def test_fsdp_mixed_precision_zero2_and_accumulation():
    n = total(debug_args())
    p = plan(cfg("--optimization.precision=bf16", "--optimization.zero_stage=2",
                 "--training.gradient_accumulation_steps=2"), 2)
    m = p.stages[0].memory
    assert m["params"] == 4 * n // 2  # fp32 masters also in bf16
    assert m["compute_params"] == 2 * n  # zero 2: every layer's bf16 copy stays until its backward
    # zero 2 reduce-scatters every micro-step: the first micro-step's sharded fp32 gradients are held
    assert m["grads"] == 4 * n // 2 and m["grad_accumulation"] == 0
    assert "reduce-scattered every micro-step" in p.layout["accumulation"]
    unsharded = plan(cfg("--optimization.precision=bf16", "--optimization.zero_stage=2",
                         "--training.gradient_accumulation_steps=2", "--optimization.accumulate_unsharded=true"), 2)
    m = unsharded.stages[0].memory
    assert m["grad_accumulation"] == 4 * n  # no-sync micro-steps keep unsharded fp32 gradients ...
    assert m["grads"] == 0  # ... and no sharded ones beside them until the last reduce-scatter
    assert m["step_grads"] == 4 * n // 2


def test_ddp_replicates_and_buckets():
    n = total(debug_args())
    p = plan(cfg("--optimization.zero_stage=0"), 4)
    st = p.stages[0]
    assert p.layout["wrap"] == "ddp" and st.params == n
    assert st.memory["ddp_buckets"] == 4 * n and st.memory["optimizer"] == 8 * n
    assert st.checkpoint_write == -(-(12 * n + 4 * 39 + plan_mod.SMALL_STATE_BYTES) // 4)  # replicas share it
    assert p.checkpoint["unique_bytes"] == 12 * n + 4 * 39 + plan_mod.SMALL_STATE_BYTES


def test_checkpoint_times_and_delta_ratio_from_results():
    p = plan(cfg("--checkpoint.full_every=4", "--checkpoint.interval=10"), 2, storage_gbps=0.5)
    ck = p.checkpoint
    assert ck["delta_ratio"] == 0.780 and "RESULTS.md" in ck["source"]
    assert ck["seconds_parallel"] == pytest.approx(ck["per_rank_max_bytes"] / 0.5e9)
    assert ck["seconds_shared"] == pytest.approx(ck["full_bytes"] / 0.5e9)
    assert ck["seconds"] == ck["seconds_parallel"]
    assert plan(cfg(), 2, storage_shared=True).checkpoint["seconds"] == pytest.approx(ck["full_bytes"] / 2e9)
    assert ck["mean_bytes_per_save"] == (ck["full_bytes"] + 3 * ck["delta_bytes"]) // 4
    far = plan(cfg("--checkpoint.interval=500"), 2).checkpoint
    assert far["delta_ratio"] == 0.818 and far["delta_ratio_extrapolated"]


# ---------------------------------------------------------------------------------------------------
# Activations: the formula against the tensors autograd saves in a real block


def saved_bytes(block: torch.nn.Module, x: torch.Tensor, autocast: bool = False) -> int:
    cos, sin = rope_tables(block.attention.head_dim, x.shape[1], 10000.0)
    skip = {t.untyped_storage().data_ptr() for t in [*block.parameters(), cos, sin]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            block(x, cos, sin)
    return sum(seen.values())


@pytest.mark.parametrize("kv", [2, 4, 1], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
def test_layer_activation_formula_matches_autograd(mode, kv):
    torch.manual_seed(0)
    a = ModelArgs(dim=128, n_layers=1, n_heads=4, n_kv_heads=kv, multiple_of=64)
    block = TransformerBlock(0, a)
    b, s = 2, 24
    x = torch.randn(b, s, a.dim)
    if mode == "bf16":  # what FSDP2's mixed precision runs: bf16 parameters and activations
        block, x = block.bfloat16(), x.bfloat16()
    autocast = mode == "autocast"
    measured = saved_bytes(block, x.requires_grad_(), autocast)
    weights = 2 * sum(p.numel() for p in block.parameters() if p.dim() == 2) if autocast else 0  # the cached casts
    num = plan_mod.numerics("fp32" if mode == "fp32" else "bf16", "none" if autocast else "fsdp")
    assert measured - weights == plan_mod.layer_activation_bytes(a, num, 1, b, s)


def test_activation_checkpointing_keeps_the_block_input():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    a = debug_args()
    block = checkpoint_wrapper(TransformerBlock(0, a).bfloat16(), preserve_rng_state=False)
    b, s = 2, 24
    x = torch.randn(b, s, a.dim, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_tables(a.head_dim, s, a.rope_theta)
    seen = {}
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) and t,
            lambda t: t):
        block(x, cos, sin)
    num = plan_mod.numerics("bf16", "fsdp")
    inputs = seen.pop(x.untyped_storage().data_ptr())
    assert inputs == plan_mod.layer_input_bytes(a, num, 1, b, s)
    assert set(seen.values()) <= {cos.untyped_storage().nbytes()}  # the rotary tables: buffers


# ---------------------------------------------------------------------------------------------------
# The seed's 70B file


def test_seed_70b_plans_on_64_ranks_on_the_meta_device(monkeypatch):
    built = []
    real = plan_params.meta_model
    monkeypatch.setattr(plan_params, "meta_model", lambda a: built.append(real(a)) or built[-1])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    p = plan(cfg(config=SEED_70B), 64)  # no timing: the meta build and the RSS bound show nothing is allocated
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) < 2**20  # < 1 GiB (KiB): nothing allocated
    (model,) = built
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert p.model["params"] == 68_976_648_192
    assert (p.layout["dp_shard"], p.layout["tp"], p.layout["pp"], p.layout["zero_stage"]) == (4, 4, 4, 2)
    assert p.layout["layers_per_stage"] == [20, 20, 20, 20]
    assert [st.in_flight for st in p.stages][0] == 4 and p.stages[-1].in_flight == 1
    # TP 4 x PP 4: every rank's share of the model; norms are replicated over TP.
    a = FLAVORS["70b"]
    c = counts(a)
    norms_per_stage = 20 * c["layer_norms"]
    split_layers = 20 * (layer(c) - c["layer_norms"]) // 4
    assert p.stages[1].params_local == split_layers + norms_per_stage
    assert p.stages[0].params_local == split_layers + norms_per_stage + c["embedding"] // 4
    assert p.stages[3].params_local == split_layers + norms_per_stage + c["norm"] + c["output"] // 4
    assert p.stages[1].params == p.stages[1].params_local // 4  # FSDP over 4, every dim 0 divides
    assert p.checkpoint["unique_bytes"] == 12 * 68_976_648_192 + 4 * (2 + 9 * 80 + 1) + plan_mod.SMALL_STATE_BYTES
    assert any("training.batch_size=256" in problem for problem in p.problems)  # 256 != 1 x 8 x 4
    text = format_plan(p)
    assert "first stage (0)" in text and "middle 1-2" in text and "last stage (3)" in text
    assert "68,976,648,192" in text and "Korthikanti" in text and "RESULTS.md" in text
    assert p.verdict["fits"] is None and set(p.verdict["by_device"]) == set(KNOWN_DEVICES)


def test_seed_70b_at_the_seeds_sequence_length_plans_what_zero_2_promises():
    # The file leaves seq_len at the default 128: the plan says what the seeds use instead.
    assert any("--training.seq_len 2048" in note for note in plan(cfg(config=SEED_70B), 64).notes)
    p = plan(cfg("--training.seq_len=2048", config=SEED_70B), 64)
    assert not any("seq_len" in note for note in p.notes)
    st = p.stages[0]
    m, P, P_l = st.memory, st.params, st.params_local
    # zero_stage 2 reduce-scatters every pipeline microbatch: the held gradients are the sharded fp32
    # ones, never the unsharded no-sync buffer, and they are not counted twice.
    assert m["grad_accumulation"] == 0 and m["grads"] == m["step_grads"] == 4 * P
    assert "reduce-scattered every micro-step" in p.layout["accumulation"]
    # ZeRO-2 (Rajbhandari et al.): 2 bytes of half-precision parameters per (TP/PP-local) parameter
    # plus (2 + 12) / dp sharded: fp16 gradients, fp32 masters and Adam's moments. This trainer's
    # sharded gradients are fp32 (FSDP2 keeps them in the masters' dtype): 2 bytes / dp more.
    zero2 = 2 * P_l + 14 * P_l / 4
    held = m["params"] + m["optimizer"] + m["grads"] + m["compute_params"]
    assert held == pytest.approx(zero2 + 2 * P_l / 4, rel=1e-5)
    assert 1.0 < st.peak / zero2 < 1.2  # the rest: activations, one reduce-scatter, a recomputed layer
    assert st.phases["backward start"] == st.peak


def test_70b_on_too_few_devices_does_not_fit(capsys):
    code = main(["--config", SEED_70B, "--distributed.tp_size=1", "--distributed.pp_size=1",
                 "--distributed.dp_size=8", "--world-size=8", "--device-memory", "H100"])
    out = capsys.readouterr().out
    assert code == 0
    assert "H100 79.6 GiB (--device-memory): does not fit by" in out
    p = plan(cfg("--distributed.tp_size=1", "--distributed.pp_size=1", "--distributed.dp_size=8",
                 config=SEED_70B), 8, device_memory_gib=80)
    assert p.verdict["fits"] is False and p.verdict["text"].startswith("does not fit by")
    assert p.verdict["spare_gib"] == pytest.approx(80 - p.peak / GIB, abs=0.01)
    seed = plan(cfg("--training.seq_len=4096", config=SEED_70B), 64, device="H200")
    assert seed.verdict["fits"] is True and seed.verdict["text"].startswith("fits")


# ---------------------------------------------------------------------------------------------------
# Memory options of newer configurations (set on the Config directly: the plan reads them with
# getattr, so these tests hold with or without the keys in trainer/config/schema.py)


def test_op_level_checkpointing_keeps_matmul_and_attention_outputs():
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    aten = torch.ops.aten
    kept_ops = {aten.mm.default, aten.addmm.default, aten.bmm.default,
                aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default}

    class Outputs(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in kept_ops:
                self.nbytes += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                                   if isinstance(t, torch.Tensor))
            return out

    for kv in (2, 1):
        for mode in ("fp32", "bf16", "autocast"):
            a = ModelArgs(dim=128, n_layers=1, n_heads=4, n_kv_heads=kv, multiple_of=64)
            block = TransformerBlock(0, a)
            b, s = 2, 24
            x = torch.randn(b, s, a.dim)
            if mode == "bf16":
                block, x = block.bfloat16(), x.bfloat16()
            cos, sin = rope_tables(a.head_dim, s, a.rope_theta)
            outputs = Outputs()
            with outputs, torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
                block(x, cos, sin)
            num = plan_mod.numerics("fp32" if mode == "fp32" else "bf16", "none" if mode == "autocast" else "fsdp")
            expected = x.numel() * x.element_size() + outputs.nbytes  # the block's input + the kept outputs
            assert plan_mod.layer_op_level_bytes(a, num, 1, b, s) == expected, (kv, mode)


def test_checkpointing_every_other_block_and_op_level():
    a = debug_args()
    base = plan(cfg("--optimization.gradient_checkpointing=true"), 2)
    c = cfg("--optimization.gradient_checkpointing=true")
    c.optimization.ac_every = 2
    every = plan(c, 2)
    b, s = 4, 128
    num = plan_mod.numerics("fp32", "fsdp")
    full = plan_mod.layer_activation_bytes(a, num, 1, b, s)
    kept = plan_mod.layer_input_bytes(a, num, 1, b, s)
    assert base.stages[0].memory["activations"] == 4 * kept + 8 * b * s
    assert every.stages[0].memory["activations"] == 2 * kept + 2 * full + 8 * b * s  # layers 0 and 2
    c.optimization.ac_every, c.optimization.ac_op_level = 1, True
    op = plan(c, 2)
    assert op.stages[0].memory["activations"] == 4 * plan_mod.layer_op_level_bytes(a, num, 1, b, s) + 8 * b * s
    assert op.stages[0].memory["recompute"] == full
    assert "op-level" in format_plan(op)


def test_cpu_offload_moves_the_sharded_state_to_the_host():
    n = total(debug_args())
    c = cfg()
    c.optimization.cpu_offload = True
    st = plan(c, 2).stages[0]
    assert st.memory["params"] == st.memory["grads"] == st.memory["optimizer"] == st.memory["optimizer_step"] == 0
    assert st.memory["step_grads"] == 0
    assert st.host_offload == 16 * (n // 2)
    assert st.memory["compute_params"] > 0  # the all-gathered copies are on the device
    with pytest.raises(plan_mod.ParallelismError, match="cpu_offload needs FSDP2"):
        plan(c, 1)


def test_bf16_moments_and_masters_halve_what_they_store():
    a = debug_args()
    n, c = total(a), counts(a)
    largest = max(c[k] for k in ("embedding", "wq", "w1", "w2", "output")) // 2  # a w1/w2/w3 shard (dim 0 even)
    bf16 = ["--optimization.precision=bf16"]
    for extra, (master, moment) in (([], (4, 4)), (["--optimization.optimizer_state_dtype=bf16"], (4, 2)),
                                    (["--optimization.master_dtype=bf16", "--optimization.optimizer_state_dtype=bf16"],
                                     (2, 2))):
        p = plan(cfg(*bf16, *extra), 2)
        m = p.stages[0].memory
        assert (m["params"], m["optimizer"], m["step_grads"]) == (master * n // 2, 2 * moment * n // 2, master * n // 2)
        lean = (master, moment) != (4, 4)
        # foreach AdamW: an fp32 temporary of every parameter; LeanAdamW: of its largest tensor only
        assert m["optimizer_step"] == (plan_memory.LEAN_STEP_BYTES[(master, moment)] * largest if lean else 4 * n // 2)
        tensors = 2 + 9 * a.n_layers + 1
        assert p.checkpoint["unique_bytes"] == (master + 2 * moment) * n + 4 * tensors + plan_mod.SMALL_STATE_BYTES
        assert f"{master + 2 * moment} B/param" in format_plan(p)


def test_fp16_plans_like_bf16():
    c = cfg("--optimization.precision=bf16")
    bf16 = plan(c, 2)
    c.optimization.precision = "fp16"
    fp16 = plan(c, 2)
    assert fp16.stages[0].memory == bf16.stages[0].memory
    assert fp16.layout["numerics"] == "fp16 (FSDP2 mixed precision)"


def test_pipeline_refusals_and_problems():
    with pytest.raises(plan_mod.ParallelismError, match="cannot wrap pipeline stages"):
        plan(cfg("--parallelism.pp=2", "--optimization.zero_stage=0"), 4)
    p = plan(cfg("--parallelism.pp=2", "--training.gradient_accumulation_steps=4"), 2)
    assert not p.problems  # the accumulation's micro-batches are the pipeline's microbatches
    assert p.batch["pipeline_microbatches"] == 4 and p.batch["pipeline_microbatch_size"] == 2
    p = plan(cfg("--parallelism.pp=2", "--parallelism.pp_microbatches=3"), 2)
    assert any("not divisible by 3" in problem for problem in p.problems)
