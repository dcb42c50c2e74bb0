"""The plan as a readable report: model, layout, one column per rank role, verdict, checkpoint, formulas.

Contract: :func:`format_plan` renders a :class:`~trainer.plan.result.Plan` (what ``--dry-run``
prints; the JSON of ``--json`` is :meth:`~trainer.plan.result.Plan.to_dict`); it computes nothing.
:func:`mib` is the unit the plan's formulas are written in.
"""

from __future__ import annotations

from .checkpoint import ENCODE_GBPS_PER_CORE
from .devices import GIB, KNOWN_DEVICES
from .result import ITEMS, Plan


def _in(unit: int):
    return lambda n: f"{n / unit:.2f}"


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _size(n: int | float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _seconds(t: float) -> str:
    if t < 0.1:
        return f"{t * 1000:.1f} ms"
    return f"{t:.1f} s" if t < 120 else f"{t / 60:.1f} min"


def _layers(layers: list[int]) -> str:
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
    return ",".join(map(str, layers))


def format_plan(p: Plan) -> str:
    """The plan as a readable report: model, layout, one column per rank role, verdict, checkpoint."""
    m, lay, bt, ck = p.model, p.layout, p.batch, p.checkpoint
    a = m["args"]
    lines = [f"Dry run{' of ' + p.source if p.source else ''}: {m['name']} {m['flavor']} on "
             f"{lay['world_size']} ranks (nothing started; the model is built on the meta device)", ""]
    ref = m.get("llama2_reference")
    check = "" if ref is None else (f" = Llama-2 {m['flavor'].upper()}'s {ref:,}" if ref == m["params"]
                                    else f", Llama-2 {m['flavor'].upper()} has {ref:,}")
    lines.append(f"Model      {m['params']:,} parameters{check}")
    kv = a["n_kv_heads"] or a["n_heads"]
    lines.append(f"           dim {a['dim']}, {a['n_layers']} layers, {a['n_heads']} heads ({kv} kv, head dim "
                 f"{m['head_dim']}), SwiGLU {m['ffn_hidden_dim']}, vocab {a['vocab_size']}")
    by = m["params_by_module"]
    lines.append("           " + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in by.items()))
    cp = f"cp {lay['cp']} x " if lay.get("cp", 1) > 1 else ""
    lines.append(f"Layout     dp_replicate {lay['dp_replicate']} x dp_shard {lay['dp_shard']} x {cp}tp {lay['tp']} x "
                 f"pp {lay['pp']} = {lay['world_size']}; data parallel: {lay['data_parallel']}")
    ac = "off"
    if lay["activation_checkpointing"]:
        ac = "on (" + ("op-level: matmul and attention outputs kept" if lay["ac_op_level"] else
                       "full recomputation per block")
        ac += f", one block in {lay['ac_every']})" if lay["ac_every"] > 1 else ")"
    where = ("parameters, gradients and optimizer state offloaded to the host (optimization.cpu_offload)"
             if lay["cpu_offload"] else "optimizer state on the device"
             + ("" if lay["offload_option"] else " (no offload option)"))
    lines.append(f"           {lay['numerics']}; activation checkpointing {ac}; {where}")
    grads = f"; FSDP2 gradients {lay['accumulation']}" if lay.get("accumulation") else ""
    loss = ("loss parallel over tp" if lay.get("loss_parallel") else "whole logits per rank") + (
        f", chunks of {lay['loss_chunk_len']} positions" if 0 < lay.get("loss_chunk_len", 0) < bt["seq_len"]
        else ", one chunk")
    lines.append(f"           masters {lay.get('master_dtype', 'fp32')}, AdamW moments "
                 f"{lay.get('optimizer_state_dtype', 'fp32')}{grads}; loss: {loss}")
    lines.append(f"Batch      global {bt['global_batch']} = micro {bt['micro_batch_size']} x accumulation "
                 f"{bt['gradient_accumulation_steps']} x dp {bt['dp']}"
                 + ("" if bt["micro_batch_size"] * bt["gradient_accumulation_steps"] * bt["dp"] == bt["global_batch"]
                    else f" = {bt['micro_batch_size'] * bt['gradient_accumulation_steps'] * bt['dp']} (!)")
                 + f"; seq_len {bt['seq_len']}")
    if lay["pp"] > 1:
        per_stage = lay["layers_per_stage"]
        lines.append(f"Pipeline   {lay['pipeline_schedule']}, {bt['pipeline_microbatches']} microbatches of "
                     f"{bt['pipeline_microbatch_size']}; layers per stage {'/'.join(map(str, per_stage))}; "
                     "embedding on stage 0, norm + output on the last; in flight "
                     + "/".join(str(st.in_flight) for st in p.stages))
    lines.append("")

    cols = [(r["name"], p.stages[r["stage"]]) for r in p.roles]
    width = max(44, *(len(label) + 2 for label in ITEMS.values()))
    colw = max(14, *(len(name) + 2 for name, _ in cols))
    row = lambda label, values: f"{label:<{width}}" + "".join(f"{v:>{colw}}" for v in values)  # noqa: E731
    unit, scale = ("GiB", GIB) if p.peak >= GIB else ("MiB", 2**20)
    _gib = _in(scale)
    lines.append(row(f"Per rank ({unit})", [name for name, _ in cols]))
    lines.append(row("layers", [_layers(st.layers) for _, st in cols]))
    lines.append(row("parameters after TP/PP", [f"{st.params_local:,}" for _, st in cols]))
    lines.append(row("parameters stored (after FSDP)", [f"{st.params:,}" for _, st in cols]))
    if lay["pp"] > 1:
        lines.append(row("microbatches in flight", [str(st.in_flight) for _, st in cols]))
    for key, label in ITEMS.items():
        values = [st.memory[key] for _, st in cols]
        if any(values):
            lines.append(row("  " + label, [_gib(v) for v in values]))
    lines.append(row("peak", [_gib(st.peak) for _, st in cols]))
    if all(st.phases for _, st in cols):
        lines.append(row("  reached at", [max(st.phases, key=st.phases.get) for _, st in cols]))
    if any(st.host_offload for _, st in cols):
        lines.append(row("host: offloaded params + grads + AdamW", [_gib(st.host_offload) for _, st in cols]))
    flip = "off" if lay["activation_checkpointing"] else "on"
    lines.append(row(f"peak with activation checkpointing {flip}",
                     [_gib(st.peak_other_checkpointing) for _, st in cols]))
    lines.append("")

    v, dev = p.verdict, p.device
    if dev["memory_gib"] is not None:
        lines.append(f"Verdict    {dev['name'] or 'device'} {dev['memory_gib']:.1f} GiB ({dev['source']}): "
                     f"{v['text']} (fullest rank: stage {v['fullest_stage']}, {v['peak_gib']:.2f} GiB)")
    else:
        lines.append(f"Verdict    {dev['source']}; the fullest rank (stage {v['fullest_stage']}) needs "
                     f"{v['peak_gib']:.2f} GiB:")
        for name, text in v["by_device"].items():
            lines.append(f"           {name} {KNOWN_DEVICES[name]:.1f} GiB: {text}")
    lines.append("")

    off = "" if ck["enabled"] else " (checkpoint.enable = false: nothing is written; if it were)"
    lines.append(f"Checkpoint{off}")
    stored = (f"{lay.get('master_dtype', 'fp32')} params + AdamW ({lay.get('optimizer_state_dtype', 'fp32')} moments)"
              if (lay.get("master_dtype"), lay.get("optimizer_state_dtype")) not in ((None, None), ("fp32", "fp32"))
              else "fp32 params + AdamW")
    lines.append(f"           unique state {_size(ck['unique_bytes'])} ({stored}, {ck.get('bytes_per_param', 12)} B/param, + small "
                 f"state); DCP writes each piece once over {ck['writers']} ranks "
                 f"({ck['replicas_per_piece']} holder{'s' if ck['replicas_per_piece'] > 1 else ''} per piece)")
    full = f"full {_size(ck['full_bytes'])}" + (f" (zstd x{ck['full_ratio']})" if ck["compress"] == "zstd" else "")
    link = (f"one shared {ck['storage_gbps']:g} GB/s link" if ck["storage_shared"]
            else f"{ck['storage_gbps']:g} GB/s per rank in parallel")
    lines.append(f"           {full}; per rank up to {_size(ck['per_rank_max_bytes'] * ck['full_ratio'])}; "
                 f"{_seconds(ck['seconds'])} at {link}"
                 + ("" if ck["storage_shared"] else f" ({_seconds(ck['seconds_shared'])} through one shared link)"))
    extra = " (extrapolated: measured up to 100)" if ck["delta_ratio_extrapolated"] else ""
    lines.append(f"           delta ~{_size(ck['delta_bytes'])} (x{ck['delta_ratio']} raw: fp32 + AdamW, interval "
                 f"{ck['delta_ratio_interval']} in {ck['source']}{extra}); {_seconds(ck['delta_seconds'])} to write; "
                 f"encoding {_seconds(ck['delta_encode_cpu_seconds_per_rank'])} of one core per rank at "
                 f"{ENCODE_GBPS_PER_CORE} GB/s")
    if ck["full_every"] > 1:
        lines.append(f"           full_every {ck['full_every']}: {_size(ck['mean_bytes_per_save'])} "
                     "per save on average")
    else:
        lines.append("           checkpoint.full_every = 1: every save is full (deltas need full_every > 1)")
    if ck["staging_host_bytes_per_rank"]:
        lines.append(f"           host memory for double-buffered staging: {_size(ck['staging_host_bytes_per_rank'])} "
                     "per rank (2 x its local state)")
    lines.append("")
    lines.append("Formulas")
    lines.extend(f"           {f}" for f in p.formulas)
    for title, items in (("Notes", p.notes), ("PROBLEMS", p.problems)):
        if items:
            lines.append(title)
            lines.extend(f"           {i}" for i in items)
    return "\n".join(lines)
