"""Rich tables for `phalanx plan`: one device in detail, or every device side by side."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from phalanx.plan.memory import CATEGORIES
from phalanx.plan.planner import GIB, Job

out = Console()
MAX_ROWS = 12  # candidates shown in a proposal's table


def print_plan(r: dict[str, Any]) -> None:
    memory = r["memory"]
    title = (
        f"{r['source']} ({_count(r['params'])} params) on {r['devices']} x {r['device']}: "
        f"{r['strategy']}, {r['dtype']}, micro batch {r['micro_batch']} x {r['seq_len']} tokens"
        f"{', accumulation ' + str(r['accumulation']) if r['accumulation'] > 1 else ''}"
        f"{', activation checkpointing' if r['activation_checkpointing'] else ''}"
    )
    at_peak = Table(title=f"memory per rank at its peak ({memory['peak_at']})", title_justify="left")
    at_peak.add_column("live then")
    at_peak.add_column("GiB", justify="right")
    for category in CATEGORIES:
        if memory["at_peak"].get(category):
            at_peak.add_row(category, _gib(memory["at_peak"][category]))
    at_peak.add_row("peak", _gib(memory["peak_bytes"]), style="bold")
    at_peak.add_row(
        f"usable ({r['device_memory_gib']:.0f} GiB less {r['headroom']:.0%} headroom"
        f"{', shared by the ranks' if r['device_kind'] == 'cpu' else ''})",
        f"{r['usable_gib_per_rank']:.2f}",
    )

    summary = Table(show_header=False, title=title, title_justify="left")
    other = r["other_activation_checkpointing"]
    rows = {
        "fits": _fits(r["fits"]),
        "largest micro batch that fits": _batch(r["max_micro_batch"]),
        "resident per rank": (
            f"parameters {_gib(memory['parameters'])}, gradients {_gib(memory['gradients'])}, "
            f"optimizer {_gib(memory['optimizer_states'])}"
            + (f", DDP buckets {_gib(memory['ddp_buckets'])}" if memory["ddp_buckets"] else "")
            + " GiB"
        ),
        "activations saved for backward": f"{_gib(memory['activations'])} GiB",
        f"with activation checkpointing {'on' if other['activation_checkpointing'] else 'off'}": f"peak {other['peak_gib']:.2f} GiB, {_fits(other['fits'])}, "
        f"largest micro batch {_batch(other['max_micro_batch'])}",
        f"projected at {r['mfu']:.0%} MFU": (
            f"{r['tokens_per_sec']:,.0f} tokens/s in all, {r['tokens_per_sec_per_device']:,.0f} per rank"
        ),
        "device": f"{r['peak_tflops']:,.1f} TFLOP/s peak; {r['device_source']}",
    }
    for key, value in rows.items():
        summary.add_row(key, value)
    out.print(summary)
    out.print(at_peak)


def print_compare(job: Job, rows: list[dict[str, Any]], mfu: float, headroom: float) -> None:
    title = (
        f"{job.name} on {job.world_size} devices of each kind: {job.strategy}, micro batch {job.micro_batch} "
        f"x {job.seq_len} tokens{', activation checkpointing' if job.activation_checkpointing else ''}; "
        f"{headroom:.0%} headroom, tokens/s at {mfu:.0%} MFU. Peak GiB is per rank at micro batch "
        f"{job.micro_batch}; max B is the largest micro batch that fits, without and with activation "
        "checkpointing"
    )
    table = Table(title=title, title_justify="left")
    for column in ("device", "GiB", "dtype", "peak GiB", "fits", "max B", "max B (AC)", "tok/s"):
        table.add_column(column, justify="left" if column in ("device", "dtype") else "right")
    for row in rows:
        table.add_row(
            row["device"],
            f"{row['memory_gib']:.0f}",
            row["dtype"],
            f"{row['peak_gib']:.2f}",
            _fits(row["fits"]),
            _batch(row["max_micro_batch"]),
            _batch(row["max_micro_batch_with_ac"]),
            "-" if row["tokens_per_sec"] is None else f"{row['tokens_per_sec']:,.0f}",
        )
    out.print(table)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def _fits(fits: bool) -> str:
    return "[green]yes[/green]" if fits else "[red]no[/red]"


def _batch(batch: int) -> str:
    return str(batch) if batch else "none"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def print_layouts(r: dict[str, Any]) -> None:
    """A layout plan or proposal: every candidate with why it lost, then the chosen one in detail."""
    job = r["job"]
    title = (
        f"{job['source']} ({_count(job['params'])} params) on {job['devices']} x {r['device']}: micro batch "
        f"{job['micro_batch']} x {job['seq_len']} tokens; {r['headroom']:.0%} headroom, tokens/s at "
        f"{r['mfu']:.0%} MFU less bubble and exposed communication"
    )
    table = Table(title=title, title_justify="left")
    with_cp = any(row["layout"]["cp"] > 1 for row in r["candidates"])  # a column only where it says something
    with_ep = any(row["layout"].get("ep", 1) > 1 for row in r["candidates"])
    for column in (
        "pp",
        "dp",
        "tp",
        *(["cp"] if with_cp else []),
        *(["ep"] if with_ep else []),
        "m",
        "AC",
        "GiB",
        "fits",
        "bubble",
        "comm",
        "tok/s",
        "why not",
    ):
        table.add_column(
            column, justify="left" if column == "why not" else "right", no_wrap=column in ("why not", "tok/s")
        )
    chosen = r["chosen"]
    for row in r["candidates"][:MAX_ROWS]:
        lay = row["layout"]
        style = "bold" if chosen and lay == chosen["layout"] else None
        dp = f"{lay['dp_replicate']}x{lay['dp_shard']}" if lay["dp_replicate"] > 1 else str(lay["dp_shard"])
        table.add_row(
            str(lay["pp"]),
            dp,
            str(lay["tp"]),
            *([str(lay["cp"])] if with_cp else []),
            *([str(lay.get("ep", 1))] if with_ep else []),
            str(lay["microbatches"]),
            "on" if row["activation_checkpointing"] else "off",
            f"{row['peak_gib']:.0f}",
            _fits(row["fits"]),
            f"{row['bubble_fraction']:.0%}",
            f"{row['communication_gib']:.0f}",
            f"{row['tokens_per_sec']:,.0f}",
            row.get("why_not", "chosen" if style else ""),
            style=style,
        )
    out.print(table)
    if len(r["candidates"]) > MAX_ROWS:
        out.print(
            f"... and {len(r['candidates']) - MAX_ROWS} more (--json lists them all). m: micro-batches per "
            "step per replica; GiB: peak per rank; comm: GiB one rank sends per step"
        )
    out.print(f"[bold]layout:[/bold] {r['reason']}")
    if chosen is None:
        return
    detail = Table(show_header=False, title=f"{chosen['describe']}, per rank", title_justify="left")
    memory = chosen["memory"]
    detail.add_row("peak (hand model)", f"{memory['peak_gib']:.2f} GiB at {memory['peak_at']}")
    detail.add_row(
        "live at that peak",
        ", ".join(f"{c} {_gib(memory['at_peak'][c])}" for c in CATEGORIES if memory["at_peak"].get(c)) + " GiB",
    )
    detail.add_row(
        "resident",
        f"parameters {_gib(memory['parameters'])}, gradients {_gib(memory['gradients'])}, optimizer "
        f"{_gib(memory['optimizer_states'])} GiB; activations saved {_gib(memory['activations'])} GiB a micro-batch",
    )
    traced = chosen.get("traced")
    if traced:
        detail.add_row(
            "peak (traced step)",
            f"{traced['peak_gib']:.2f} GiB, hand/traced {traced['hand_over_traced']:.3f}"
            f" ({traced['seconds']:.0f} s on fake tensors)",
        )
        if traced["optimizer_step_from_hand"]:
            detail.add_row("optimizer step", "its peak is the hand model's (the trace counts through backward)")
        if traced["more_micro_batches_gib"]:
            detail.add_row(
                "micro-batches beyond the traced one",
                f"+{traced['more_micro_batches_gib']:.2f} GiB (in flight or accumulated; hand model)",
            )
    elif chosen.get("trace_skipped"):
        detail.add_row("traced step", chosen["trace_skipped"])
    detail.add_row("usable", f"{chosen['usable_gib_per_rank']:.2f} GiB")
    detail.add_row("stage", f"{chosen['stage_layers']} blocks, {chosen['dtype']}")
    for kind, nbytes in chosen["communication_bytes"].items():
        detail.add_row(f"{kind} per step", f"{nbytes / GIB:,.1f} GiB")
    timing = chosen["timing"]
    detail.add_row(
        "step",
        f"{timing['step_s']:.2f} s: compute {timing['compute_s']:.2f}, bubble "
        f"{timing['bubble_s']:.2f}, exposed communication {timing['exposed_comm_s']:.2f}",
    )
    detail.add_row("projected", f"{chosen['tokens_per_sec']:,.0f} tokens/s ({timing['tokens_per_step']:,} per step)")
    out.print(detail)
