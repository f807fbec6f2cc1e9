"""The preflight's verdict: one row per check (which rank or node, the value, what was expected, pass /
warn / fail / skip), the nodes to keep out of the job and why, and the distinct error it ends with."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("pass", "warn", "fail", "skip", "info")


@dataclass
class CheckResult:
    check: str  # a name from thresholds.CHECK_NAMES, or an informational one (inventory, collective sizes)
    status: str  # one of STATUSES
    value: float | str | None = None
    unit: str = ""
    expected: str = "-"
    node: str | None = None  # None: the whole job
    rank: int | None = None
    message: str = ""

    @property
    def where(self) -> str:
        if self.rank is not None:
            return f"rank {self.rank} ({self.node})"
        return self.node or "all"


@dataclass
class PreflightReport:
    checks: list[CheckResult]
    failed_nodes: dict[str, str]  # node -> why it failed (one line)
    cluster_failures: list[str]  # failures no single node can be blamed for
    nodes: dict[str, dict[str, Any]]  # node -> inventory and health as measured
    world_size: int
    backend: str
    device_type: str
    quick: bool
    seconds: float
    slow_ranks: dict[str, Any] = field(default_factory=dict)  # the bisection's findings
    node: str | None = None  # the node whose launcher produced this report
    recorded: list[str] = field(default_factory=list)  # nodes whose result went to the run store
    quarantined: list[str] = field(default_factory=list)  # nodes quarantined there by this preflight
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    @property
    def warnings(self) -> int:
        return sum(c.status == "warn" for c in self.checks)

    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == "fail"]

    def for_node(self, node: str) -> dict[str, Any]:
        """What the run store keeps for one node: its own checks and the job-wide ones."""
        return {
            "passed": node not in self.failed_nodes and not self.cluster_failures,
            "reason": self.failed_nodes.get(node),
            "cluster_failures": self.cluster_failures,
            "device_type": self.device_type,
            "world_size": self.world_size,
            "quick": self.quick,
            "checks": [asdict(c) for c in self.checks if c.node in (node, None)],
            "inventory": self.nodes.get(node, {}).get("inventory"),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "node": self.node,
            "warnings": self.warnings,
            "failed_nodes": self.failed_nodes,
            "cluster_failures": self.cluster_failures,
            "world_size": self.world_size,
            "backend": self.backend,
            "device_type": self.device_type,
            "quick": self.quick,
            "seconds": self.seconds,
            "slow_ranks": self.slow_ranks,
            "recorded": self.recorded,
            "quarantined": self.quarantined,
            "notes": self.notes,
            "checks": [asdict(c) for c in self.checks],
            "nodes": self.nodes,
        }

    def failure_line(self) -> str:
        """One line for the error message: what failed where."""
        parts = [f"{node}: {why}" for node, why in self.failed_nodes.items()] + self.cluster_failures
        return "; ".join(parts) or "a check failed"
