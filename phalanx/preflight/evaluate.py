"""Grade the ranks' raw measurements (worker.py) against the limits (thresholds.py) into a report,
and decide which nodes to blame for what failed.

A failure measured on a rank or a node blames that node. A failure of the whole job (a collective, a
slow place found by bisection) blames the node the bisection pointed at when it lies within one node,
the only node when there is one, and otherwise no node: it is a cluster failure (often the fabric),
and quarantining every node for it would help nobody.
"""

from __future__ import annotations

import statistics
from typing import Any

from phalanx.preflight.inventory import compare
from phalanx.preflight.report import CheckResult, PreflightReport
from phalanx.preflight.thresholds import UNITS, Limit, device_limits, device_type

# health.py's field -> the check grading it, and how a node's devices combine into one figure
HEALTH_CHECKS = {
    "temperature_c": ("gpu_temperature_c", max),
    "power_cap_fraction": ("power_cap_fraction", min),
    "ecc_correctable": ("ecc_correctable", sum),
    "ecc_uncorrectable": ("ecc_uncorrectable", sum),
    "retired_pages": ("retired_pages", sum),
    "row_remap_pending": ("row_remap_pending", sum),
    "row_remap_failed": ("row_remap_failed", sum),
}


def evaluate(raw: dict[str, Any], overrides: dict[str, float] | None = None) -> PreflightReport:
    gpu = raw["gpu"]
    rank_limits = {r["rank"]: device_limits(r["device_name"], gpu, overrides) for r in raw["ranks"]}
    job_limits = rank_limits[0]
    nodes = raw["nodes"]
    checks: list[CheckResult] = []
    checks += _inventory(nodes)
    for node, info in nodes.items():
        limits = rank_limits[info["ranks"][0]]
        checks.append(
            _grade(
                "disk_write_mbps",
                info.get("disk_write_mbps"),
                limits,
                node=node,
                detail=f"at {info['inventory']['runs_dir']}",
            )
        )
        checks.append(
            _grade(
                "disk_free_gib",
                info["inventory"]["disk_free_gib"],
                limits,
                node=node,
                detail=f"at {info['inventory']['runs_dir']}",
            )
        )
        checks += _health(node, info["health"], limits)
    checks += _ranks(raw["ranks"], rank_limits, gpu)
    suspects = _suspects(raw)
    checks += _collectives(raw["collectives"], job_limits, raw["world_size"])
    checks += _slow_ranks(raw, job_limits, suspects)
    suspect_nodes = sorted({r["node"] for r in raw["ranks"] if r["rank"] in suspects})
    failed_nodes, cluster = _blame(checks, list(nodes), suspect_nodes)
    return PreflightReport(
        checks=checks,
        failed_nodes=failed_nodes,
        cluster_failures=cluster,
        nodes={
            n: {key: i[key] for key in ("host", "node_rank", "launcher", "ranks", "inventory", "health")}
            for n, i in nodes.items()
        },
        world_size=raw["world_size"],
        backend=raw["backend"],
        device_type=device_type(raw["ranks"][0]["device_name"], gpu),
        quick=raw["quick"],
        seconds=raw["seconds"],
        slow_ranks=_describe_suspects(raw, suspects),
    )


def _grade(
    check: str,
    value: float | None,
    limits: dict[str, Limit],
    node: str | None = None,
    rank: int | None = None,
    detail: str = "",
) -> CheckResult:
    limit = limits.get(check)
    if limit is None:  # measured, but this device type has no limit for it (an unknown GPU)
        return CheckResult(
            check,
            "info" if value is not None else "skip",
            value,
            UNITS.get(check, ""),
            node=node,
            rank=rank,
            message=detail,
        )
    status = limit.status(value)
    message = detail
    if status in ("warn", "fail"):
        bound = limit.fail if status == "fail" else limit.warn
        side = "below" if limit.higher_is_better else "above"
        message = (
            f"{_fmt(value)} {limit.unit} is {side} the {'failure' if status == 'fail' else 'warning'} "
            f"limit {_fmt(bound)}" + (f" ({detail})" if detail else "")
        )
    elif status == "skip":
        message = detail or "not measured"
    return CheckResult(check, status, value, limit.unit, limit.describe(), node, rank, message)


def _inventory(nodes: dict[str, dict[str, Any]]) -> list[CheckResult]:
    inventories = {node: info["inventory"] for node, info in nodes.items()}
    mismatches = compare(inventories)
    if not mismatches:
        only = next(iter(inventories.values()))
        runtime = f"hip {only['hip']}" if only.get("hip") else f"cuda {only['cuda']}" if only.get("cuda") else None
        devices = only["accelerator"] if only["accelerator"] != "none" else "no GPU"
        summary = ", ".join(
            filter(
                None,
                (
                    f"torch {only['torch']}",
                    runtime,
                    devices,
                    f"{only['cpu_threads']} CPU threads",
                    f"{only['ram_gib']:.0f} GiB RAM",
                ),
            )
        )
        return [CheckResult("inventory_match", "pass", f"{len(nodes)} node(s) agree", message=summary)]
    rows = []
    for m in mismatches:
        values = ", ".join(f"{node}={value}" for node, value in m["values"].items())
        blamed = m["odd"] or [None]
        for node in blamed:
            rows.append(
                CheckResult(
                    "inventory_match",
                    "fail",
                    m["field"],
                    expected="equal on every node",
                    node=node,
                    message=f"{m['field']} differs between nodes: {values}",
                )
            )
    return rows


def _health(node: str, health: dict[str, Any], limits: dict[str, Limit]) -> list[CheckResult]:
    if not health["devices"]:
        return [CheckResult("gpu_health", "skip", node=node, message=health["note"] or "no devices reported")]
    rows = []
    for field, (check, combine) in HEALTH_CHECKS.items():
        readings = [(d[field], d["index"]) for d in health["devices"] if d.get(field) is not None]
        if not readings:
            continue  # the board or library does not report it
        value = combine(v for v, _ in readings)
        worst = max(readings, key=lambda r: r[0]) if combine is not min else min(readings, key=lambda r: r[0])
        detail = f"GPU {worst[1]}" if combine is not sum else f"{len(readings)} GPUs"
        rows.append(_grade(check, value, limits, node=node, detail=f"{detail}, via {health['source']}"))
    power = [d["power_w"] for d in health["devices"] if d.get("power_w") is not None]
    if power:
        rows.append(
            CheckResult(
                "gpu_power_w", "info", max(power), "W", node=node, message=f"highest of {len(power)} GPUs at rest"
            )
        )
    return rows


def _ranks(ranks: list[dict[str, Any]], limits: dict[int, dict[str, Limit]], gpu: bool) -> list[CheckResult]:
    rows = []
    for r in ranks:
        for check in ("matmul_bf16_tflops", "matmul_fp32_tflops", "memory_bandwidth_gbps"):
            rows.append(_grade(check, r.get(check), limits[r["rank"]], node=r["node"], rank=r["rank"]))
    if len(ranks) > 1:
        # the dtype training uses: bf16 on GPUs, fp32 on CPUs (parallel/device.py)
        key = "matmul_bf16_tflops" if gpu else "matmul_fp32_tflops"
        for r in ranks:
            peers = statistics.median(p[key] for p in ranks if p is not r)
            ratio = peers / r[key] if r[key] else float("inf")
            rows.append(
                _grade(
                    "compute_straggler_ratio",
                    ratio,
                    limits[r["rank"]],
                    node=r["node"],
                    rank=r["rank"],
                    detail=f"the other ranks' median {key} over this rank's",
                )
            )
    return rows


def _collectives(results: list[dict[str, Any]], limits: dict[str, Limit], world: int) -> list[CheckResult]:
    if world < 2:
        return [CheckResult("collectives", "skip", message="one rank: no collective to measure")]
    rows = []
    largest = max(r["bytes"] for r in results)
    for r in results:
        check = f"{r['op']}_busbw_gbps"
        detail = f"{_size(r['bytes'])}, {r['seconds'] * 1e3:.3g} ms, algbw {r['algbw_gbps']:.4g} GB/s"
        if r["bytes"] == largest:  # smaller messages measure latency; only the largest is graded
            rows.append(_grade(check, r["busbw_gbps"], limits, detail=detail))
        else:
            rows.append(CheckResult(check, "info", r["busbw_gbps"], "GB/s", message=detail))
    return rows


def _suspects(raw: dict[str, Any]) -> list[int]:
    bisection = raw.get("bisection")
    return list(bisection["suspects"]) if bisection else []


def _slow_ranks(raw: dict[str, Any], limits: dict[str, Limit], suspects: list[int]) -> list[CheckResult]:
    bisection = raw.get("bisection")
    if not bisection:
        return [CheckResult("slow_rank_ratio", "skip", message="one rank: nothing to compare")]
    node_of = {r["rank"]: r["node"] for r in raw["ranks"]}
    nodes = sorted({node_of[r] for r in suspects})
    if not suspects:
        detail = "no slow rank: collectives run evenly in every part of the group"
    elif len(suspects) == 1:
        detail = f"rank {suspects[0]} on {node_of[suspects[0]]} slows collectives (bisection)"
    else:
        detail = f"ranks {_ranks_text(suspects)} on {', '.join(nodes)} slow collectives (bisection)"
    row = _grade(
        "slow_rank_ratio",
        bisection["ratio"],
        limits,
        node=nodes[0] if len(nodes) == 1 else None,
        rank=suspects[0] if len(suspects) == 1 else None,
        detail=detail,
    )
    if row.status == "pass":
        row.message = detail if suspects else row.message
    return [row]


def _blame(checks: list[CheckResult], nodes: list[str], suspect_nodes: list[str]) -> tuple[dict[str, str], list[str]]:
    """A failing check's own node; for a job-wide check, the node bisection found or the only node."""
    failed: dict[str, list[str]] = {}
    cluster: list[str] = []
    job_node = suspect_nodes[0] if len(suspect_nodes) == 1 else nodes[0] if len(nodes) == 1 else None
    for c in checks:
        if c.status != "fail":
            continue
        where = f" on rank {c.rank}" if c.rank is not None else ""
        reason = f"{c.check}{where}: {c.message}" if c.message else c.check
        # an unattributable version mismatch is the cluster's, whatever else was found
        node = c.node or (job_node if c.check != "inventory_match" else None)
        if node is None:
            cluster.append(reason)
        else:
            failed.setdefault(node, []).append(reason)
    return {node: "; ".join(reasons) for node, reasons in failed.items()}, cluster


def _describe_suspects(raw: dict[str, Any], suspects: list[int]) -> dict[str, Any]:
    bisection = raw.get("bisection")
    if not bisection:
        return {}
    node_of = {r["rank"]: r["node"] for r in raw["ranks"]}
    return {
        "ranks": suspects,
        "nodes": sorted({node_of[r] for r in suspects}),
        "ratio": bisection["ratio"],
        "levels": bisection["levels"],
        "leaf": bisection["leaf"],
    }


def _ranks_text(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ", ".join(map(str, ranks))


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def _fmt(value: Any) -> str:
    return f"{value:,.4g}" if isinstance(value, (int, float)) else str(value)
