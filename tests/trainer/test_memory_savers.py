"""Memory savers change memory, not results: activation checkpointing (full, every n-th block,
op-level) gives the losses of a run without it; fp16 with the sharded loss scaler trains and resumes
exactly (the scaler's state travels in the checkpoint)."""

from __future__ import annotations

import math

import pytest

from tests.support import models
from tests.support.trainer_runs import run_trainer, trainer_args

STEPS = 4


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_losses(tmp_path):
    plain = run_trainer(trainer_args(str(tmp_path / "plain"), steps=STEPS))[0]
    for name, extra in {
        "full": {"optimization__gradient_checkpointing": "true"},
        "every-2nd": {"optimization__gradient_checkpointing": "true", "optimization__ac_every": 2},
        "op-level": {"optimization__gradient_checkpointing": "true", "optimization__ac_op_level": "true"},
    }.items():
        assert run_trainer(trainer_args(str(tmp_path / name), steps=STEPS, **extra))[0] == plain, name  # recomputation is exact


@pytest.mark.slow
def test_fp16_with_the_loss_scaler_trains_and_resumes_exactly(tmp_path):
    fp16 = {"optimization__precision": "fp16", "checkpoint__enable": "true", "checkpoint__interval": 2}
    straight, straight_state, _ = run_trainer(trainer_args(str(tmp_path / "straight"), steps=STEPS, **fp16))
    assert all(math.isfinite(loss) for loss in straight) and straight[-1] < straight[0]
    first, _, _ = run_trainer(trainer_args(str(tmp_path / "resumed"), steps=STEPS, **fp16), stop_at=2)
    second, resumed_state, _ = run_trainer(trainer_args(str(tmp_path / "resumed"), steps=STEPS, **fp16))
    assert first + second == straight
    models.assert_same(resumed_state, straight_state)

    import ckpt

    saved = ckpt.read_manifest(tmp_path / "resumed" / "checkpoints" / "step-00000002")
    assert {"scaler.scale", "scaler.growth_tracker"} <= set(saved.values)


def test_compiled_blocks_checkpoint_under_the_same_names(tmp_path):
    """optimization.compile wraps each block in torch.compile; the checkpoint's keys (model and
    optimizer) and bytes stay those of the plain model, so runs with and without compile share
    checkpoints (torchtitan #961: `_orig_mod.` must not leak). Compilation itself is lazy: no forward
    is needed to check the names."""
    import torch

    import ckpt
    from trainer import model as model_mod
    from trainer.parallel import apply_compile

    args = model_mod.model_args("debug", vocab_size=model_mod.BYTE_VOCAB_SIZE)
    saved = {}
    for name, compiled in (("plain", False), ("compiled", True)):
        torch.manual_seed(0)
        model = model_mod.build(args)
        if compiled:
            apply_compile(model)
        optimizer = torch.optim.AdamW(model.parameters())
        ckpt.save({"model": model, "optim": optimizer}, tmp_path / name)
        saved[name] = ckpt.read_manifest(tmp_path / name)
    assert saved["plain"].tensors.keys() == saved["compiled"].tensors.keys()
    assert not any("_orig_mod" in key for key in saved["compiled"].tensors)
    assert [c.blob.checksum for e in saved["plain"].tensors.values() for c in e.chunks] == \
        [c.blob.checksum for e in saved["compiled"].tensors.values() for c in e.chunks]


def test_op_level_checkpointing_saves_every_fused_attention_kernel(monkeypatch):
    """The save list of op-level checkpointing resolves the matmuls and every SDPA kernel torch has
    (cuDNN's and a PrivateUse1 device's among them, and the memory-efficient forward the CP causal
    bias calls) without importing torch_npu; with torch_npu loaded (a stand-in module, and its fused
    attention ops defined on CPU) it adds those ops, the ones torch_npu does not define left out."""
    import sys
    import types

    import torch
    from torch.library import _scoped_library

    from trainer.parallel import op_level_saved_ops

    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    aten = torch.ops.aten
    expected = {aten.mm.default, aten.addmm.default, aten.bmm.default,
                aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
                aten._scaled_dot_product_cudnn_attention.default,
                aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_fused_attention_overrideable.default,
                aten._efficient_attention_forward.default}
    assert op_level_saved_ops() == expected
    assert "torch_npu" not in sys.modules

    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    with _scoped_library("npu", "FRAGMENT") as lib:
        for name in ("npu_fusion_attention", "npu_fusion_attention_v3"):
            lib.define(f"{name}(Tensor query, Tensor key, Tensor value, int head_num, str input_layout) -> Tensor")
        npu = op_level_saved_ops() - expected
        assert npu == {torch.ops.npu.npu_fusion_attention.default, torch.ops.npu.npu_fusion_attention_v3.default}
