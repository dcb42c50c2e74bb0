"""Loss parity: loss parallel (vocabulary-sharded logits into torch's loss_parallel cross-entropy) and
the chunked loss (trainer.loss) give the losses of the previous path, whole logits on every rank in
one shot, and FSDP2's sharded gradient accumulation those of the no-sync one. fp32 throughout;
the tolerance is stated: TOLERANCE absolute on losses near 6 (reassociation only: the sums of
exponentials and the chunks' sums are added in another order)."""

from __future__ import annotations

import pytest
import torch

from tests.support.launch import run_ranks
from tests.support.trainer_runs import run_trainer, trainer_args
from trainer import model as model_mod
from trainer.loss import lm_loss

TOLERANCE = 1e-5
STEPS = 3
PREVIOUS = {"optimization__loss_parallel": "false", "optimization__loss_chunk_len": 0}
CHUNKED = {"optimization__loss_chunk_len": 16}  # 4 chunks of the tests' 64-token sequences


def test_chunked_loss_and_its_gradients_equal_the_one_shot_loss():
    torch.manual_seed(0)
    model = model_mod.build(model_mod.model_args("debug"))
    tokens = torch.randint(0, 258, (3, 40))
    labels = torch.randint(0, 258, (3, 40))
    losses, grads = [], []
    for chunk in (0, 7, 40, 64):  # one shot; 6 chunks, the last shorter; exactly one; longer than s
        model.zero_grad()
        model.loss_chunk_len = chunk
        loss = model(tokens, labels=labels)
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    reference = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).item()
    assert losses[0] == reference and losses[2] == losses[3] == losses[0]  # the one-shot path, bit for bit
    assert losses[1] == pytest.approx(reference, abs=1e-6)
    assert torch.allclose(grads[1], grads[0], atol=1e-7, rtol=1e-5)


def test_chunked_head_frees_the_logits_between_chunks():
    """Saved for backward: the one-shot loss keeps the whole fp32 log-softmax, a chunked one keeps
    nothing as large as even one chunk's logits (only its inputs: views of the hidden states)."""
    torch.manual_seed(0)
    output = torch.nn.Linear(16, 1000, bias=False)
    h = torch.randn(2, 64, 16, requires_grad=True)
    labels = torch.randint(0, 1000, (2, 64))

    def largest_saved(chunk: int) -> int:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            lm_loss(h, output, labels, chunk)
        return max(saved)

    assert largest_saved(0) >= 2 * 64 * 1000 * 4  # log-softmax of every token, fp32
    assert largest_saved(8) < 2 * 8 * 1000 * 4  # less than one chunk's logits


def _runs(rank: int, world: int, root: str, runs: dict) -> dict[str, list[float]]:
    return {name: run_trainer(trainer_args(f"{root}/{name}", steps=STEPS, **extra))[0] for name, extra in runs.items()}


def _assert_parity(results: dict[str, list[float]], reference: str) -> None:
    for name, losses in results.items():
        worst = max(abs(a - b) for a, b in zip(losses, results[reference], strict=True))
        assert worst < TOLERANCE, (name, worst, losses, results[reference])


@pytest.mark.slow
def test_loss_parallel_and_chunked_loss_match_the_gathered_logits_on_two_ranks(tmp_path):
    tp = {"parallelism__tp": 2}
    runs = {"previous": {**tp, **PREVIOUS}, "loss-parallel": tp, "loss-parallel-chunked": {**tp, **CHUNKED},
            "gathered-chunked": {**tp, **PREVIOUS, **CHUNKED},
            # FSDP2 over 2 ranks, 2 micro-steps: sharded accumulation (the default) against no-sync
            "fsdp-sharded-accumulation": {"training__gradient_accumulation_steps": 2},
            "fsdp-unsharded-accumulation": {"training__gradient_accumulation_steps": 2,
                                            "optimization__accumulate_unsharded": "true"}}
    results = run_ranks(2, _runs, str(tmp_path), runs)[0]
    _assert_parity({k: v for k, v in results.items() if not k.startswith("fsdp")}, "previous")
    _assert_parity({k: v for k, v in results.items() if k.startswith("fsdp")}, "fsdp-unsharded-accumulation")


@pytest.mark.slow
def test_loss_parallel_and_chunked_loss_with_fsdp_and_the_pipeline_on_four_ranks(tmp_path):
    """FSDP2 2 x TP 2, and PP 2 x TP 2 where the last stage owns the loss (given the labels)."""
    fsdp_tp = {"parallelism__tp": 2, "parallelism__dp_shard": 2}
    pp_tp = {"parallelism__tp": 2, "parallelism__pp": 2, "parallelism__pp_microbatches": 4}
    pp_fsdp = {"parallelism__pp": 2, "parallelism__dp_shard": 2}
    runs = {"fsdp-tp-previous": {**fsdp_tp, **PREVIOUS}, "fsdp-tp-loss-parallel": {**fsdp_tp, **CHUNKED},
            "pp-tp-previous": {**pp_tp, **PREVIOUS}, "pp-tp-loss-parallel": {**pp_tp, **CHUNKED},
            "pp-fsdp-sharded": pp_fsdp, "pp-fsdp-unsharded": {**pp_fsdp, "optimization__accumulate_unsharded": "true"}}
    results = run_ranks(4, _runs, str(tmp_path), runs)[0]
    for prefix, reference in (("fsdp-tp", "fsdp-tp-previous"), ("pp-tp", "pp-tp-previous"),
                              ("pp-fsdp", "pp-fsdp-unsharded")):
        _assert_parity({k: v for k, v in results.items() if k.startswith(prefix)}, reference)
    _assert_parity({"a": results["fsdp-tp-previous"], "b": results["pp-tp-previous"],
                    "c": results["pp-fsdp-sharded"]}, "a")  # and the layouts agree with one another


def _saved_last_dims(rank: int, world: int, root: str) -> tuple[set[int], int]:
    """One training step of the trainer with TP 2: the last dimension of every tensor autograd saved
    for backward (a DTensor's local shard), and the vocabulary size."""
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(trainer_args(root, steps=1, parallelism__tp=2, checkpoint__enable="false")))
    try:
        dims: set[int] = set()

        def pack(saved: torch.Tensor) -> torch.Tensor:
            local = saved.to_local() if hasattr(saved, "to_local") else saved
            if local.dim() >= 2:
                dims.add(local.shape[-1])
            return saved

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved):
            trainer.train_step()
        return dims, trainer.model_args.vocab_size
    finally:
        trainer.close()


def test_tensor_parallel_training_keeps_the_logits_vocabulary_sharded_into_the_loss(tmp_path):
    """Loss parallel is entered on the trainer's own path (assembly, step, loss): the cross-entropy
    runs on each rank's V/2 logits and saves its log-softmax at that width. Outside torch's
    loss_parallel() (or with replicated logits) DTensor gathers the whole vocabulary first, and a
    [tokens, V] tensor is saved on every rank: the loss values alone cannot tell the two apart."""
    results = run_ranks(2, _saved_last_dims, str(tmp_path / "run"))
    for dims, vocab in results:
        assert vocab // 2 in dims, (sorted(dims), vocab)  # the local logits were seen
        assert vocab not in dims, f"whole-vocabulary logits saved for backward: {sorted(dims)} (vocab {vocab})"
