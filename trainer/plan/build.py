"""The dry-run plan of one configuration on a world size: :func:`plan` puts the pieces together.

Contract: :func:`plan` takes a validated :class:`~trainer.config.Config` and returns a
:class:`~trainer.plan.result.Plan` (no process group, no device, no tensor: the model is built on
the meta device); it raises ConfigError / ParallelismError for what cannot work
(:mod:`trainer.plan.layout`) and lists under ``problems`` what the trainer would refuse later but
does not stop the arithmetic (a batch that does not add up, a pipeline's microbatches). The
figures come from :mod:`~trainer.plan.params`, :mod:`~trainer.plan.memory`,
:mod:`~trainer.plan.checkpoint` and :mod:`~trainer.plan.devices`.
"""

from __future__ import annotations

from typing import Any

from .. import model as model_mod
from ..config import Config, ConfigError, TrainingConfig
from ..parallel import accumulates_unsharded
from ..pipeline import layer_ranges, microbatch_count
from . import memory
from . import params
from .activations import Numerics, korthikanti_layer_bytes, numerics
from .checkpoint import checkpoint_info
from .devices import device as device_section
from .devices import verdict
from .layout import Layout, resolve_layout, schedule, virtual_stages
from .report import mib
from .result import Plan


SEQ_LEN_DEFAULT = TrainingConfig.seq_len


def _batch(cfg: Config, dp: int, pp: int, problems: list[str]) -> dict[str, Any]:
    t = cfg.training
    try:
        micro, accumulation = cfg.resolve_batch(dp)
    except ConfigError as exc:
        problems.append(f"{exc} (the trainer refuses this with exit 2; planned with micro_batch_size="
                        f"{t.micro_batch_size or max(1, t.batch_size // dp)})")
        micro = t.micro_batch_size or max(1, t.batch_size // dp)
        accumulation = t.gradient_accumulation_steps or 1
    out = {"global_batch": t.batch_size, "micro_batch_size": micro, "gradient_accumulation_steps": accumulation,
           "dp": dp, "seq_len": t.seq_len, "tokens_per_microbatch": micro * t.seq_len}
    if pp > 1:
        # A step's per-rank batch (micro x accumulation sequences) goes through the pipeline schedule
        # at once, in parallelism.pp_microbatches microbatches (none: the accumulation steps, or pp
        # without accumulation) — as trainer.train does.
        per_rank = micro * accumulation
        n = microbatch_count(getattr(cfg.parallelism, "pp_microbatches", None), accumulation, pp)
        if per_rank % n:
            problems.append(f"the per-rank batch of a step ({per_rank} sequences) is not divisible by {n} "
                            "pipeline microbatches")
        size = max(1, per_rank // n)
        out.update(pipeline_microbatches=n, pipeline_microbatch_size=size, tokens_per_microbatch=size * t.seq_len)
    return out


def _moe_note(args, lay: Layout, batch: dict[str, Any], num: Numerics) -> str:
    """What the plan says about a mixture of experts: what EP divides, the all-to-all buffers."""
    tokens = batch["tokens_per_microbatch"]
    copies = tokens * args.top_k * args.dim * num.e
    ep = getattr(lay, "ep", 1)
    where = (f"expert parallel {ep}: the routed experts (parameters, gradients, optimizer state) are divided by "
             f"{ep} on each rank and replicated over the {lay.dp // ep} ranks holding the same experts"
             if ep > 1 else "no expert parallel: the experts are FSDP-sharded like every other parameter")
    buffers = (f"; all-to-all buffers per MoE block and microbatch: the routed token copies sent and received, "
               f"2 x {tokens} tokens x top_k {args.top_k} x dim {args.dim} = {2 * copies / 2**20:.1f} MiB, "
               "the received ones kept for backward" if ep > 1 else "")
    return (f"mixture of experts ({args.num_experts} experts, top {args.top_k}): {where}{buffers}; activations are "
            "planned as a dense block (the experts' top_k x routed copies are not in the peak)")


def plan(cfg: Config, world_size: int, *, device_memory_gib: float | None = None, device: str | None = None,
         storage_gbps: float = 2.0, storage_shared: bool = False, source: str | None = None) -> Plan:
    """The dry-run plan of ``cfg`` on ``world_size`` ranks (see :mod:`trainer.plan.memory` and
    :mod:`trainer.plan.checkpoint` for every formula). ``device_memory_gib`` or ``device`` (a
    :data:`~trainer.plan.devices.KNOWN_DEVICES` name) sets the memory to judge against; otherwise
    training.device = npu means the Ascend 910B and any other device is judged against every known
    device. Raises ConfigError / ParallelismError for a configuration or layout that cannot work."""
    if not storage_gbps > 0:
        raise ConfigError(f"the storage speed must be > 0 GB/s, got {storage_gbps}")
    args = params.model_args_for(cfg)
    lay = resolve_layout(cfg, world_size, args)
    o = cfg.optimization
    problems: list[str] = []
    notes: list[str] = []
    num = numerics(o.precision, lay.wrap)
    # Options of newer builds of the configuration (absent: what this trainer did before them).
    ac_every = max(1, int(getattr(o, "ac_every", 1) or 1))
    op_level = bool(getattr(o, "ac_op_level", False))
    batch = _batch(cfg, lay.dp, lay.pp, problems)
    pp_schedule, virtual = schedule(cfg), virtual_stages(cfg)

    model = params.meta_model(args)
    assert all(p.is_meta for p in model.parameters())
    total = model_mod.num_params(model)
    ranges = layer_ranges(args.n_layers, lay.pp * virtual)
    per, layer_local = params.rank_params(model, lay, ranges)
    mb = memory.microbatch(args, num, lay.tp, batch, op_level=op_level,
                           loss_parallel=bool(getattr(o, "loss_parallel", False)),
                           chunk_len=int(getattr(o, "loss_chunk_len", 0) or 0), cp=lay.cp)
    stages = memory.stage_plans(cfg, lay, num, mb, batch, per, layer_local, ranges, pp_schedule)

    model_info = params.model_info(cfg, args, model, total, notes)
    dev = device_section(cfg, device_memory_gib, device)
    ckpt_info = checkpoint_info(cfg, total, len(list(model.parameters())), stages, lay, storage_gbps, storage_shared)
    layout = _layout_info(cfg, lay, num, pp_schedule, virtual, ranges)
    if lay.pp > 1 and pp_schedule == "interleaved1f1b":
        notes.append("interleaved 1F1B: in-flight microbatches estimated as for 1F1B")
    if o.compile:
        notes.append("optimization.compile: compiled blocks may save less than eager (not modelled)")
    if args.is_moe:
        notes.append(_moe_note(args, lay, batch, num))
    if cfg.training.seq_len == SEQ_LEN_DEFAULT and cfg.model.flavor.lower() in params.LLAMA2_PARAMS:
        notes.append(f"training.seq_len is the default {SEQ_LEN_DEFAULT}, which makes activations negligible for "
                     f"a {cfg.model.flavor} model: the seeds train 7B-70B at 2048 tokens a sequence (their FSDP "
                     "article: batch 1 per card, sequence 2048); plan with --training.seq_len 2048")

    b, s = mb.b, mb.s
    chunk, loss_par = int(getattr(o, "loss_chunk_len", 0) or 0), bool(getattr(o, "loss_parallel", False))
    formulas = [
        f"activations per layer and microbatch ({b} x {s} tokens{f' of {s * lay.cp} (cp {lay.cp})' if lay.cp > 1 else ''}, "
        f"{num.name}, tp {lay.tp}): "
        f"b*ceil(s/tp)*(8h + 2*{num.e_norm}h + 8) + b*s*{num.gathered_inputs}*{num.e}h + "
        f"b*s*(4*{num.e}h + 4a + 4*{num.e}f)/tp = {mib(mb.layer)} "
        f"(Korthikanti et al. s*b*h*(34 + 5as/h)/tp, GPT block storing attention scores: "
        f"{mib(korthikanti_layer_bytes(args, lay.tp, b, s))})"
        + (f"; context parallel: + gathered keys/values b*(S-s)*2*{num.e}*hd*kv + chunk masks "
           f"{num.e}*(2cp+1)*(S/2cp)^2 included" if lay.cp > 1 else ""),
        (f"with op-level activation checkpointing a layer keeps its input b*ceil(s/tp)*{num.e_input}h and its "
         f"matmul/attention outputs b*s*({num.e}*(2h + 2kv*hd + 2f)/tp + 4a/tp + 2*{num.e}h) = {mib(mb.kept_layer)}"
         if op_level else
         f"with activation checkpointing a layer keeps its input b*ceil(s/tp)*{num.e_input}h = {mib(mb.kept_layer)}")
        + f", plus one layer recomputed ({mib(mb.layer)})"
        + (f"; only layers with index % {ac_every} == 0 are checkpointed" if ac_every > 1 else ""),
        f"last stage: final norm + gathered output input + logits/log-softmax/gradient "
        f"b*{'chunk' if 0 < chunk < s else 's'}*({num.e}+8)*V{'/tp' if lay.tp > 1 and loss_par else ''}"
        f" = {mib(mb.head)}" + (f" (chunked loss: {chunk} positions at a time)" if 0 < chunk < s else "")
        + (" (loss parallel: the logits stay split by vocabulary over tp)" if lay.tp > 1 and loss_par else ""),
        "peak = params + optimizer (+ DDP buckets) + buffers + the fullest of: backward start (held gradients + "
        "norm/output gradients + compute copies + unsharded accumulation + reduce-scatter + activations + "
        "recomputed layer + loss + pipeline stage outputs), backward end (this step's gradients, activations down to one layer's, no "
        "loss) and the optimizer step (gradients at the step + its temporaries)",
    ]
    return Plan(source=source, model=model_info, layout=layout, batch=batch, stages=stages,
                roles=memory.roles(stages), device=dev, verdict=verdict(stages, dev), checkpoint=ckpt_info,
                formulas=formulas, notes=notes, problems=problems)


def _layout_info(cfg: Config, lay: Layout, num: Numerics, pp_schedule: str, virtual: int,
                 ranges: list[range]) -> dict[str, Any]:
    o = cfg.optimization
    if lay.wrap == "fsdp":
        hsdp = f", HSDP x{lay.dp_replicate} replicas" if lay.dp_replicate > 1 else ""
        reshard = "reshard after forward" if o.zero_stage == 3 else "no reshard after forward"
        over = f"dp_shard {lay.dp_shard}" + (f" x cp {lay.cp}" if lay.cp > 1 else "")
        data_parallel = f"FSDP2 over {over}{hsdp}, zero_stage {o.zero_stage} ({reshard})"
    elif lay.wrap == "ddp":
        data_parallel = f"DDP over {lay.dp_cp} ranks (zero_stage 0)"
    else:
        data_parallel = "none (one data-parallel rank: the model is not wrapped)"
    return {
        "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "cp": lay.cp, "tp": lay.tp, "pp": lay.pp,
        "world_size": lay.world_size, "data_parallel": data_parallel,
        "wrap": lay.wrap, "zero_stage": o.zero_stage, "precision": o.precision, "numerics": num.name,
        "activation_checkpointing": bool(o.gradient_checkpointing),
        "ac_every": int(getattr(o, "ac_every", 1) or 1), "ac_op_level": bool(getattr(o, "ac_op_level", False)),
        "cpu_offload": bool(getattr(o, "cpu_offload", False)), "offload_option": hasattr(o, "cpu_offload"),
        "master_dtype": getattr(o, "master_dtype", "fp32"), "optimizer_state_dtype": getattr(o, "optimizer_state_dtype", "fp32"),
        "accumulation": ("whole fp32 gradients until the last micro-step (accumulate_unsharded)"
                         if accumulates_unsharded(o.zero_stage, getattr(o, "accumulate_unsharded", None))
                         else "reduce-scattered every micro-step (sharded)") if lay.wrap == "fsdp" else None,
        "loss_parallel": lay.tp > 1 and bool(getattr(o, "loss_parallel", False)),
        "loss_chunk_len": int(getattr(o, "loss_chunk_len", 0) or 0),
        "pipeline_schedule": pp_schedule if lay.pp > 1 else None, "pp_virtual_stages": virtual,
        "layers_per_stage": [len(r) for r in ranges],
    }
