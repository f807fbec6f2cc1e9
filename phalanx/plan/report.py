"""Rich tables for `phalanx plan`: one device in detail, or every device side by side."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from phalanx.plan.memory import CATEGORIES
from phalanx.plan.planner import GIB, Job

out = Console()


def print_plan(r: dict[str, Any]) -> None:
    memory = r["memory"]
    title = (f"{r['source']} ({_count(r['params'])} params) on {r['devices']} x {r['device']}: "
             f"{r['strategy']}, {r['dtype']}, micro batch {r['micro_batch']} x {r['seq_len']} tokens"
             f"{', accumulation ' + str(r['accumulation']) if r['accumulation'] > 1 else ''}"
             f"{', activation checkpointing' if r['activation_checkpointing'] else ''}")
    at_peak = Table(title=f"memory per rank at its peak ({memory['peak_at']})", title_justify="left")
    at_peak.add_column("live then")
    at_peak.add_column("GiB", justify="right")
    for category in CATEGORIES:
        if memory["at_peak"].get(category):
            at_peak.add_row(category, _gib(memory["at_peak"][category]))
    at_peak.add_row("peak", _gib(memory["peak_bytes"]), style="bold")
    at_peak.add_row(f"usable ({r['device_memory_gib']:.0f} GiB less {r['headroom']:.0%} headroom"
                    f"{', shared by the ranks' if r['device_kind'] == 'cpu' else ''})",
                    f"{r['usable_gib_per_rank']:.2f}")

    summary = Table(show_header=False, title=title, title_justify="left")
    other = r["other_activation_checkpointing"]
    rows = {
        "fits": _fits(r["fits"]),
        "largest micro batch that fits": _batch(r["max_micro_batch"]),
        "resident per rank": (f"parameters {_gib(memory['parameters'])}, gradients {_gib(memory['gradients'])}, "
                              f"optimizer {_gib(memory['optimizer_states'])}"
                              + (f", DDP buckets {_gib(memory['ddp_buckets'])}" if memory["ddp_buckets"] else "")
                              + " GiB"),
        "activations saved for backward": f"{_gib(memory['activations'])} GiB",
        f"with activation checkpointing {'on' if other['activation_checkpointing'] else 'off'}":
            f"peak {other['peak_gib']:.2f} GiB, {_fits(other['fits'])}, "
            f"largest micro batch {_batch(other['max_micro_batch'])}",
        f"projected at {r['mfu']:.0%} MFU": (f"{r['tokens_per_sec']:,.0f} tokens/s in all, "
                                           f"{r['tokens_per_sec_per_device']:,.0f} per rank"),
        "device": f"{r['peak_tflops']:,.1f} TFLOP/s peak; {r['device_source']}",
    }
    for key, value in rows.items():
        summary.add_row(key, value)
    out.print(summary)
    out.print(at_peak)


def print_compare(job: Job, rows: list[dict[str, Any]], mfu: float, headroom: float) -> None:
    title = (f"{job.name} on {job.world_size} devices of each kind: {job.strategy}, micro batch {job.micro_batch} "
             f"x {job.seq_len} tokens{', activation checkpointing' if job.activation_checkpointing else ''}; "
             f"{headroom:.0%} headroom, tokens/s at {mfu:.0%} MFU. Peak GiB is per rank at micro batch "
             f"{job.micro_batch}; max B is the largest micro batch that fits, without and with activation "
             "checkpointing")
    table = Table(title=title, title_justify="left")
    for column in ("device", "GiB", "dtype", "peak GiB", "fits", "max B", "max B (AC)", "tok/s"):
        table.add_column(column, justify="left" if column in ("device", "dtype") else "right")
    for row in rows:
        table.add_row(row["device"], f"{row['memory_gib']:.0f}", row["dtype"], f"{row['peak_gib']:.2f}",
                      _fits(row["fits"]), _batch(row["max_micro_batch"]), _batch(row["max_micro_batch_with_ac"]),
                      "-" if row["tokens_per_sec"] is None else f"{row['tokens_per_sec']:,.0f}")
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
