"""Plan a 4-D layout (memory, communication, bubble, speed), and propose one when none is given.

Memory comes from two places. The hand walk (memory.py, with TP's shapes and a pipeline stage's layers
and micro-batches in flight) is instant, so it ranks every candidate. The chosen layout is then traced
(traced.py: the model built and parallelised exactly as training builds it, one step run on fake
tensors with a fake process group of the job's world size), and the traced peak decides whether it
fits; the report shows both and how far apart they are. What the trace cannot see it takes from the
hand model and says so: the micro-batches beyond the traced one (a pipeline stage's in flight,
gradient accumulation's), the optimizer step's peak, and CP's ring buffers.

A proposal considers every tp in 1, 2, 4, 8 that divides the heads, KV heads, FFN and vocabulary (TP's
collectives run per block, so it stays inside a node), every pp that keeps a stage per rank, cp as
given (context parallelism only pays for long sequences; --cp asks for it), the rest of the ranks as
FSDP; activation checkpointing where nothing fits without. Among those that fit it picks the best
projected tokens/s; within 2% of it, the smallest TP, then the fewest pipeline stages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from phalanx.errors import PhalanxError
from phalanx.models.flops import count_params, flops_per_token
from phalanx.plan.devices import Device
from phalanx.plan.memory import Workload, estimate
from phalanx.plan.parallelism import (
    GPUS_PER_NODE,
    Parallelism,
    communication,
    step_time,
    unsplit_flops_per_token,
)
from phalanx.plan.planner import GIB, Job, _check_fractions, usable_bytes

TIE = 0.02  # projected tokens/s this close count as equal: the simpler layout wins
# Fake tensors hold no values. An MoE step traces (its routing is counted into fixed slots; under expert
# parallelism its rows spread evenly, as the hand model assumes), and tiny-moe's and qwen3-30b-a3b's (512
# tokens) FSDP peaks equal the hand walk's within 0.1% (tests/plan/test_plan_moe.py, BENCHMARKS.md). But
# at 4,096 tokens qwen3-30b-a3b traces 5% above the hand model and 19% above with activation
# checkpointing, and MoE blocks under TP and MLA on the CPU's fake kernels were 13% and 19% off: none of
# it understood yet. So MoE layouts are planned from the hand model alone.
MOE_NOT_TRACED = (
    "not traced: a mixture of experts' traced step is up to 19% from the hand model at long sequences, "
    "not yet understood; hand model only for mixtures of experts"
)
MAX_TRACES = 3  # candidates traced before giving up on the hand model's ranking


def layout_workload(job: Job, device: Device, par: Parallelism, activation_checkpointing: bool) -> Workload:
    """The hand model's view of the busiest rank: its stage's layers, its slice of the sequence, TP."""
    if par.uses_fsdp:
        strategy, world = "fsdp", par.shard_degree
    elif par.dp_replicate > 1:
        strategy, world = "ddp", par.dp_replicate
    else:
        strategy, world = "none", 1
    stage = par.stage_layers(job.args)
    # The busiest stage holds the model's last layers: a mixture of experts' dense first layers sit on
    # the first stage, so a later one is all MoE blocks.
    dense = max(0, job.args.n_dense_layers - (job.args.n_layers - stage))
    args = dataclasses.replace(job.args, n_layers=stage, n_dense_layers=dense)
    return job.workload(
        device,
        args=args,
        strategy=strategy,
        world_size=world,
        seq_len=job.seq_len // par.cp,
        accumulation=par.microbatches if par.pp == 1 else 1,
        tp=par.tp,
        in_flight=par.in_flight(),
        activation_checkpointing=activation_checkpointing,
        ep=par.ep,
    )


def evaluate(
    job: Job,
    device: Device,
    par: Parallelism,
    *,
    mfu: float,
    headroom: float,
    activation_checkpointing: bool | None = None,
) -> dict[str, Any]:
    """The hand model's numbers for one layout: memory per rank, communication, bubble, speed."""
    ac = job.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    par.check(job.args, job.seq_len, job.world_size)
    workload = layout_workload(job, device, par, ac)
    memory = estimate(workload)
    usable = usable_bytes(device, job.world_size, headroom)
    comm = communication(job.args, par, job.micro_batch, job.seq_len, workload.dtype)
    timing = step_time(
        job.args,
        par,
        comm,
        micro_batch=job.micro_batch,
        seq_len=job.seq_len,
        flops_per_token=flops_per_token(job.args, job.seq_len),
        peak_tflops=device.peak_tflops,
        mfu=mfu,
        intra_gbps=device.intra_node_gbps,
        inter_gbps=device.inter_node_gbps,
        recompute=ac,
        unsplit_flops_per_token=unsplit_flops_per_token(job.args),
    )
    return {
        "layout": dataclasses.asdict(par),
        "describe": par.describe(),
        "activation_checkpointing": ac,
        "dtype": workload.dtype,
        "stage_layers": workload.args.n_layers,
        "in_flight": par.in_flight(),
        "bubble_fraction": par.bubble_fraction(),
        "memory": {**memory.as_dict(), "peak_gib": memory.peak_bytes / GIB},
        "peak_gib": memory.peak_bytes / GIB,
        "usable_gib_per_rank": usable / GIB,
        "fits": memory.peak_bytes <= usable,
        "memory_source": "hand",
        "communication_bytes": comm,
        "communication_gib": sum(comm.values()) / GIB,
        "timing": timing,
        "tokens_per_sec": timing["tokens_per_sec"],
    }


def trace(job: Job, device: Device, par: Parallelism, row: dict[str, Any]) -> dict[str, Any]:
    """Measure `row`'s layout on fake tensors; the traced peak (with the pipeline's other micro-batches
    from the hand model) replaces the hand one for `fits`."""
    from phalanx.plan.traced import trace_step

    if par.dp_replicate > 1 and par.shard_degree == 1 and par.tp == 1:  # one stage of it is plain DDP
        return {**row, "traced": None, "trace_skipped": "DDP layouts are not traced (real C++ buckets)"}
    if job.args.n_experts:
        return {**row, "traced": None, "trace_skipped": MOE_NOT_TRACED}
    workload = layout_workload(job, device, par, row["activation_checkpointing"])
    traced = trace_step(
        workload.args,
        dp_replicate=par.dp_replicate,
        dp_shard=par.shard_degree,
        tp=par.tp,
        micro_batch=job.micro_batch,
        seq_len=workload.seq_len,
        activation_checkpointing=workload.activation_checkpointing,
        dtype=workload.dtype,
    )
    # One micro-batch is traced; the others (a pipeline stage's in flight, gradient accumulation's
    # unsharded gradients) add what the hand model says they add.
    one = estimate(dataclasses.replace(workload, in_flight=1, accumulation=1))
    extra = row["memory"]["peak_bytes"] - one.peak_bytes
    # Measured through backward. After it, under the fake process group, clipping's gradient norm over
    # FSDP x TP DTensors gathers whole gradients, which a real gloo step does not (tests/plan): the
    # optimizer step's own peak, where it is the highest moment, comes from the hand model.
    measured = traced.through_backward_bytes
    optimizer = one.peak_bytes if one.peak_at == "optimizer step" else 0
    peak = max(measured, optimizer) + extra
    usable = row["usable_gib_per_rank"] * GIB
    return {
        **row,
        "fits": peak <= usable,
        "peak_gib": peak / GIB,
        "memory_source": "traced",
        "traced": {
            "peak_gib": max(measured, optimizer) / GIB,
            "raw_peak_gib": traced.peak_bytes / GIB,
            "at_peak_gib": {k: v / GIB for k, v in traced.at_peak.items()},
            "activations_gib": traced.activations / GIB,
            "seconds": traced.seconds,
            "through_backward_gib": traced.through_backward_bytes / GIB,
            "hand_peak_gib": one.peak_bytes / GIB,
            "hand_over_traced": one.peak_bytes / max(measured, optimizer),
            "optimizer_step_from_hand": optimizer > measured,
            "more_micro_batches_gib": extra / GIB,
        },
    }


def candidates(job: Job) -> list[Parallelism]:
    """Every layout of the job's ranks the proposer considers (see the module docstring)."""
    from phalanx.parallel.tensor_parallel import check_tp

    args, world = job.args, job.world_size
    out = []
    for tp in (1, 2, 4, 8):
        if tp > min(world, GPUS_PER_NODE) or world % tp:
            continue
        try:
            if tp > 1:
                check_tp(args, tp)
                if args.attention == "mla":  # not modelled (plan/parallelism.py: Parallelism.check)
                    continue
        except PhalanxError:
            continue
        pp = 1
        while pp <= args.n_layers and world % (tp * pp * job.cp) == 0:
            dp = world // (tp * pp * job.cp)
            m = microbatches(job, dp)
            for ep in expert_degrees(args, dp) if m else ():
                par = Parallelism(dp_shard=dp, tp=tp, pp=pp, cp=job.cp, schedule=job.pp_schedule, microbatches=m, ep=ep)
                try:
                    par.check(args, job.seq_len, world)
                    out.append(par)
                except PhalanxError:
                    pass
            pp *= 2
    return out


def expert_degrees(args, dp_shard: int) -> list[int]:
    """The ep degrees a proposal tries: 1, and for a mixture of experts every power of two dividing both
    the shard ranks and the experts."""
    degrees, ep = [1], 2
    while args.n_experts and dp_shard % ep == 0 and args.n_experts % ep == 0:
        degrees.append(ep)
        ep *= 2
    return degrees


def given_layout(
    job: Job,
    *,
    dp_replicate: int | None,
    dp_shard: int | None,
    tp: int | None,
    pp: int | None,
    ep: int | None = None,
) -> Parallelism:
    """The layout of the flags, the unnamed data-parallel degree taking the rest of the ranks."""
    tp, pp, cp, world = tp or 1, pp or 1, job.cp, job.world_size
    if min(tp, pp, cp, dp_replicate or 1, dp_shard or 1) < 1:
        raise PhalanxError("--tp, --pp, --cp, --dp-shard and --dp-replicate must be at least 1")
    model_parallel = tp * pp * cp
    if world % model_parallel:
        raise PhalanxError(f"--pp {pp} x --cp {cp} x --tp {tp} = {model_parallel} does not divide --gpus {world}")
    rest = world // model_parallel
    replicate = dp_replicate or (rest // dp_shard if dp_shard and rest % dp_shard == 0 else 1)
    shard = dp_shard or (rest // replicate if rest % replicate == 0 else 0)
    if replicate * shard != rest:
        raise PhalanxError(
            f"--dp-replicate {replicate} x --dp-shard {shard or '?'} x pp x cp x tp does not multiply to --gpus {world}"
        )
    m = job.pp_microbatches if pp > 1 and job.pp_microbatches else microbatches(job, replicate * shard)
    if not m:
        raise PhalanxError(
            f"the global batch of {global_batch(job)} sequences does not split into micro-batches of "
            f"{job.micro_batch} over {replicate * shard} data-parallel ranks"
        )
    par = Parallelism(
        dp_replicate=replicate,
        dp_shard=shard,
        tp=tp,
        pp=pp,
        cp=cp,
        schedule=job.pp_schedule,
        microbatches=m,
        ep=ep or 1,
    )
    par.check(job.args, job.seq_len, world)
    return par


def global_batch(job: Job) -> int:
    """Sequences per optimizer step: the job's, the same under every layout (as the trainer keeps it)."""
    ranks = job.world_size if job.strategy != "none" else 1
    return job.micro_batch * job.accumulation * ranks


def microbatches(job: Job, dp: int) -> int:
    """Micro-batches per step on each of `dp` replicas at the job's micro batch, 0 if they do not divide."""
    share = dp * job.micro_batch
    return global_batch(job) // share if global_batch(job) % share == 0 else 0


def propose(job: Job, device: Device, *, mfu: float, headroom: float, do_trace: bool = True) -> dict[str, Any]:
    """Rank the candidates by the hand model, trace the best until one fits by measurement; the report
    holds every candidate with why it lost."""
    _check_fractions(mfu, headroom)
    rows = []
    for par in candidates(job):
        row = evaluate(job, device, par, mfu=mfu, headroom=headroom)
        if not row["fits"] and not job.activation_checkpointing:
            with_ac = evaluate(job, device, par, mfu=mfu, headroom=headroom, activation_checkpointing=True)
            row = with_ac if with_ac["fits"] else row
        rows.append(row)
    if not rows:
        raise PhalanxError(
            f"no layout of {job.world_size} ranks suits the model (tp must divide the heads, KV "
            f"heads, FFN and vocabulary; pp at most its {job.args.n_layers} layers)"
        )
    order = _ranked(rows)
    chosen, traced = None, 0
    for i in order:
        if not rows[i]["fits"]:
            break
        if do_trace and traced < MAX_TRACES:
            rows[i] = trace(job, device, Parallelism(**rows[i]["layout"]), rows[i])
            traced += 1
            if not rows[i]["fits"]:
                rows[i]["why_not"] = "too big traced"
                continue
        elif do_trace:
            rows[i]["trace_skipped"] = f"not traced: the {MAX_TRACES} traces allowed went to faster layouts"
        chosen = i
        break
    for i, row in enumerate(rows):
        if i != chosen and "why_not" not in row:
            row["why_not"] = _why_not(row, rows[chosen] if chosen is not None else None)
    return {
        "job": _job_dict(job),
        "device": device.name,
        "mfu": mfu,
        "headroom": headroom,
        "chosen": rows[chosen] if chosen is not None else None,
        "candidates": [rows[i] for i in order],
        "reason": _reason(rows[chosen], rows)
        if chosen is not None
        else "no candidate fits: more devices, a shorter sequence or a smaller micro batch",
    }


def plan_layout(
    job: Job, device: Device, par: Parallelism, *, mfu: float, headroom: float, do_trace: bool = True
) -> dict[str, Any]:
    """The report for the layout the user named."""
    _check_fractions(mfu, headroom)
    row = evaluate(job, device, par, mfu=mfu, headroom=headroom)
    if do_trace:
        row = trace(job, device, par, row)
    return {
        "job": _job_dict(job),
        "device": device.name,
        "mfu": mfu,
        "headroom": headroom,
        "chosen": row,
        "candidates": [row],
        "reason": "the layout given",
    }


def _ranked(rows: list[dict[str, Any]]) -> list[int]:
    """Fitting rows first, by tokens/s with near-ties going to the smaller tp, then the fewer stages."""
    fitting = [i for i, r in enumerate(rows) if r["fits"]]
    best = max((rows[i]["tokens_per_sec"] for i in fitting), default=0.0)

    def key(i: int):
        r = rows[i]
        near = r["fits"] and r["tokens_per_sec"] >= (1 - TIE) * best
        return (
            not r["fits"],
            not near,
            r["layout"]["tp"] if near else 0,
            r["layout"]["pp"] if near else 0,
            -r["tokens_per_sec"],
            r["peak_gib"],
        )

    return sorted(range(len(rows)), key=key)


def _why_not(row: dict[str, Any], chosen: dict[str, Any] | None) -> str:
    if not row["fits"]:
        return "too big"
    if chosen is None:
        return ""
    ratio = row["tokens_per_sec"] / chosen["tokens_per_sec"]
    if ratio < 1 - TIE:
        return f"{ratio:.0%} speed"
    return "tie; more tp/pp"


def _reason(chosen: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    fitting = sum(r["fits"] for r in rows)
    layout = chosen["layout"]
    parts = [
        f"{len(rows)} layouts considered, {fitting} fit",
        (
            f"{chosen['describe']} fits ({chosen['peak_gib']:.1f} of {chosen['usable_gib_per_rank']:.1f} GiB, "
            f"{chosen['memory_source']})"
        ),
    ]
    parts.append(f"tp={layout['tp']} stays inside a node of {GPUS_PER_NODE}" if layout["tp"] > 1 else "no TP needed")
    parts.append(
        f"{layout['pp']} pipeline stages, bubble {chosen['bubble_fraction']:.1%}"
        if layout["pp"] > 1
        else "no pipeline bubble"
    )
    if chosen["activation_checkpointing"]:
        parts.append("activation checkpointing on (nothing as fast fits without)")
    parts.append(f"best projected {chosen['tokens_per_sec']:,.0f} tokens/s")
    return "; ".join(parts)


def _job_dict(job: Job) -> dict[str, Any]:
    return {
        "source": job.name,
        "params": count_params(job.args),
        "devices": job.world_size,
        "micro_batch": job.micro_batch,
        "seq_len": job.seq_len,
        "accumulation": job.accumulation,
        "activation_checkpointing": job.activation_checkpointing,
    }
