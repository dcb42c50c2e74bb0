"""The mixture of experts (trainer/moe.py) in one process: the router's top-k and load-balancing loss,
the dropless dispatch against a token-by-token dense reference (forward and gradients), the MoE
flavours and their config keys, and the expert-parallel layout rules (trainer/expert_parallel.py);
one short 4-rank step: the experts' gradients the optimizer gets under EP 2 x 2 replicas equal one
process's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.launch import run_ranks
from tests.support.moe import dense_reference
from tests.support.trainer_runs import trainer_args
from trainer import model
from trainer.config import ConfigError, load_config
from trainer.expert_parallel import check
from trainer.moe import MoE, TokenChoiceTopKRouter
from trainer.parallel import ParallelismError


def _moe(seed: int = 0, shared: bool = False) -> MoE:
    torch.manual_seed(seed)
    args = model.model_args("moe_debug", num_shared_experts=int(shared))
    moe = model.build_moe(args)
    moe.init_weights(0.02)
    return moe


def test_router_picks_the_top_k_softmax_experts_and_renormalises():
    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(16, num_experts=6, top_k=2)
    router.init_weights(std=0.5)
    x = torch.randn(40, 16)
    scores, experts, counts, aux = router(x)
    probs = F.softmax(router.gate(x), dim=-1)
    top = torch.topk(probs, 2, dim=-1)
    assert torch.equal(experts, top.indices)
    torch.testing.assert_close(scores, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(scores.sum(-1), torch.ones(40))
    assert torch.equal(counts, torch.bincount(experts.flatten(), minlength=6)) and counts.sum() == 80
    share = counts.float() / 80  # Switch Transformer: E * sum_e f_e * P_e
    torch.testing.assert_close(aux, 6 * (share * probs.mean(0)).sum())


def test_aux_loss_is_one_when_the_router_is_uniform_and_grows_with_imbalance():
    router = TokenChoiceTopKRouter(8, num_experts=4, top_k=1)
    torch.nn.init.zeros_(router.gate.weight)  # uniform probabilities: aux = sum_e f_e = 1
    x = torch.randn(32, 8)
    assert router(x)[3].item() == pytest.approx(1.0)
    with torch.no_grad():
        router.gate.weight[0] = 10.0  # expert 0 favoured for tokens with positive sums
    skewed = router(x.abs())[3]
    assert skewed.item() > 3.0  # close to E = 4: every token on one expert, which has all the probability
    skewed.backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("shared", [False, True])
def test_dropless_dispatch_equals_the_dense_per_token_reference(shared):
    moe = _moe(shared=shared)
    x = torch.randn(3, 7, 128, requires_grad=True)
    out = moe(x)
    ref_moe = _moe(shared=shared)  # the same weights, separate gradients
    x_ref = x.detach().clone().requires_grad_(True)
    ref = dense_reference(ref_moe, x_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-6)
    for (name, p), q in zip(moe.named_parameters(), ref_moe.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_unbalanced_routing_drops_nothing():
    moe = _moe()
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[3] = 1.0  # every token's top choice: expert 3, far over any capacity
    x = torch.randn(64, 128).abs()
    counts = moe.router(x)[2]
    assert counts[3] == 64  # dropless: expert 3 gets all of them
    torch.testing.assert_close(moe(x[None]), dense_reference(moe, x[None]), rtol=1e-5, atol=1e-6)


def test_moe_flavours_names_and_loss_with_the_aux_term():
    args = model.model_args("moe_debug")
    assert args.is_moe and args.num_experts == 8 and args.top_k == 2 and args.num_shared_experts == 0
    assert model.model_args("moe_small").num_shared_experts == 1
    torch.manual_seed(0)
    m = model.build(args)
    names = {n for n, _ in m.named_parameters()}
    assert "layers.0.moe.experts.w1" in names and "layers.0.moe.router.gate.weight" in names
    assert not any("feed_forward" in n for n in names)
    assert m.layers["0"].moe.experts.w1.shape == (8, 128, 128) and m.layers["0"].moe.experts.w2.shape == (8, 128, 128)
    tokens = torch.randint(0, 258, (2, 16))
    loss = m(tokens, labels=tokens)
    aux = torch.stack([layer.moe.aux_loss for layer in m.layers.values()]).mean()
    plain = F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten())
    torch.testing.assert_close(loss, plain + args.moe_aux_loss_coef * aux)
    torch.testing.assert_close(m.moe_aux_loss, aux.detach())
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    # the dense model is untouched by the MoE keys
    assert not model.model_args("debug").is_moe


def test_moe_config_keys_and_the_seed_ep_size(tmp_path):
    cfg = load_config(["--model.flavor", "moe_debug", "--model.num_shared_experts", "1", "--model.top_k", "1",
                       "--model.moe_aux_loss_coef", "0.1", "--distributed.ep_size", "2"])
    args = cfg.model_args(258)
    assert (args.num_shared_experts, args.top_k, args.moe_aux_loss_coef) == (1, 1, 0.1)
    assert cfg.parallelism.ep == 2
    with pytest.raises(ConfigError, match="top_k"):
        load_config(["--model.flavor", "moe_debug", "--model.top_k", "9"])
    with pytest.raises(ConfigError, match="parallelism.ep"):
        load_config(["--parallelism.ep", "0"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(ep=2, num_experts=0, dp_shard=2, tp=1, pp=1, zero_stage=3), "mixture-of-experts"),
    (dict(ep=3, num_experts=8, dp_shard=3, tp=1, pp=1, zero_stage=3), "divide model.num_experts"),
    (dict(ep=4, num_experts=8, dp_shard=2, tp=1, pp=1, zero_stage=3), "divide parallelism.dp_shard"),
    (dict(ep=2, num_experts=8, dp_shard=2, tp=2, pp=1, zero_stage=3), "tp = 2"),
    (dict(ep=2, num_experts=8, dp_shard=2, tp=1, pp=1, zero_stage=0), "zero_stage"),
])
def test_expert_parallel_layout_rules(kwargs, match):
    with pytest.raises(ParallelismError, match=match):
        check(**kwargs)
    check(**dict(kwargs, ep=1))  # EP 1 always fits


def test_dry_run_divides_the_experts_by_ep_and_notes_the_all_to_all():
    from trainer.plan import plan
    from trainer.plan.layout import resolve_layout
    from trainer.plan.params import meta_model, rank_params
    from trainer.pipeline import layer_ranges

    def stored(ep: int) -> int:
        cfg = load_config(["--model.flavor", "moe_debug", "--parallelism.ep", str(ep)])
        args = cfg.model_args(258)
        lay = resolve_layout(cfg, 4, args)
        return rank_params(meta_model(args), lay, layer_ranges(args.n_layers, 1))[0][0]["stored"]

    args = model.model_args("moe_debug")
    experts = args.n_layers * 3 * args.num_experts * args.dim * args.moe_ffn_dim
    # EP 1: everything FSDP-sharded over 4; EP 2: experts split over 2 only, the rest still over 4
    assert stored(2) - stored(1) == experts // 2 - experts // 4
    assert stored(4) == stored(1)
    cfg = load_config(["--model.flavor", "moe_debug", "--parallelism.ep", "2"])
    assert any("all-to-all buffers" in note for note in plan(cfg, 4).notes)
    with pytest.raises(ParallelismError, match="divide parallelism.dp_shard"):
        resolve_layout(load_config(["--model.flavor", "moe_debug", "--parallelism.ep", "4"]), 2, args)
    from trainer.measure.run import measure

    with pytest.raises(ParallelismError, match="mixture of experts"):  # routing: data-dependent shapes
        measure(cfg, 4)


def _expert_grads_against_one_process(rank: int, world: int, root: str) -> dict[str, float]:
    """One step of the trainer with EP 2 over 4 ranks (2 replicas of each expert shard, no clipping):
    for every expert weight, the largest difference between this rank's shard of the gradient the
    optimizer steps with and the same rows of one process's gradient, the mean of the 4 ranks' batch
    gradients (the trainer's data-parallel mean), relative to the largest of those rows."""
    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(trainer_args(root, steps=1, model__flavor="moe_debug", parallelism__ep=2,
                                               checkpoint__enable="false", training__max_norm=0)))
    try:
        torch.manual_seed(trainer.cfg.job.seed)  # the trainer's own initial weights, whole, in one process
        reference = model.build(trainer.model_args)
        reference.loss_chunk_len = trainer.cfg.optimization.loss_chunk_len
        seen: dict = {}
        next_batch, optimizer_step = trainer.loader.next_batch, trainer.optimizer.step

        def record_batch():
            seen["batch"] = next_batch()
            return seen["batch"]

        def record_grads(*args, **kwargs):
            seen["grads"] = {name: p.grad for name, p in trainer.model.named_parameters() if ".experts." in name}
            return optimizer_step(*args, **kwargs)

        trainer.loader.next_batch, trainer.optimizer.step = record_batch, record_grads
        trainer.train_step()

        every = [[torch.empty_like(t) for _ in range(world)] for t in seen["batch"]]
        for gathered, mine in zip(every, seen["batch"]):
            dist.all_gather(gathered, mine)
        micro, accumulation = trainer.micro_batch, trainer.accumulation
        for inputs, labels in zip(*every):  # each rank's micro-steps, as forward_backward runs them
            for m in range(accumulation):
                part = slice(m * micro, (m + 1) * micro)
                (reference(inputs[part], labels=labels[part]) / (accumulation * world)).backward()
        whole = dict(reference.named_parameters())
        assert seen["grads"] and all(".experts.w" in name for name in seen["grads"]), sorted(seen["grads"])
        errors = {}
        for name, grad in seen["grads"].items():
            shards = grad.device_mesh.size()
            expected = whole[name].grad.chunk(shards)[grad.device_mesh.get_local_rank()]
            errors[name] = float((grad.to_local() - expected).abs().max() / expected.abs().max())
        assert len(errors) == 3 * sum(1 for _ in reference.layers), sorted(errors)  # w1, w2, w3 of each block
        return errors
    finally:
        trainer.close()


def test_every_experts_gradient_is_reduced_over_its_replicas(tmp_path):
    """EP 2 x 2 replicas: each rank's expert gradients are the sum over the replicas of its shard
    (expert_parallel.sync_grads) over the data-parallel degree. One expert weight left out of that
    all-reduce keeps only its own replica group's half of the tokens: off by tens of percent, while
    the reduced ones match one process to float rounding."""
    for errors in run_ranks(4, _expert_grads_against_one_process, str(tmp_path / "run")):
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-4, (worst, errors[worst], errors)
