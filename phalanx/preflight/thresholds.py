"""What each preflight check expects, per device type, and where a measurement turns into a warning or
a failure. `--threshold NAME=VALUE` (or NAME.warn=VALUE) overrides an entry for one preflight.

The GPU figures are what a healthy device of that type reaches in these very measurements (an 8192^3
torch.matmul, a large device-to-device copy), estimated from the datasheet peaks (models/flops.py) and
published measurements; they were not measured on these machines. A healthy device lands near
`expected`: the warning floor is 80% of it, the failure floor 50% (a throttled, power-capped or
mis-clocked device). Collective bus bandwidth floors are lower fractions because they depend on how many
devices take part and on the links between nodes; set them for your fabric with --threshold. The `cpu`
row holds modest absolute floors: CPU nodes run the same checks so the machinery is exercised
everywhere, but only a broken host should fail them.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, replace

from phalanx.errors import PhalanxError


@dataclass(frozen=True)
class Limit:
    """Where a value passes, warns or fails. For higher-is-better values (throughput) `warn` and `fail`
    are floors; otherwise (temperatures, error counts, slowdown ratios) they are ceilings."""

    warn: float | None
    fail: float | None
    higher_is_better: bool = True
    unit: str = ""
    expected: float | None = None  # what a healthy device reaches, for the report

    def status(self, value: float | None) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "skip"
        worse = (lambda limit: value < limit) if self.higher_is_better else (lambda limit: value > limit)
        if self.fail is not None and worse(self.fail):
            return "fail"
        if self.warn is not None and worse(self.warn):
            return "warn"
        return "pass"

    def describe(self) -> str:
        """The limits as the report's `expected` column shows them, e.g. `≥ 560 (fail < 350)`."""
        good, bad = (">=", "<") if self.higher_is_better else ("<=", ">")
        parts = []
        if self.expected is not None:
            parts.append(f"~{_num(self.expected)}")
        if self.warn is not None:
            parts.append(f"{good} {_num(self.warn)}")
        if self.fail is not None:
            parts.append(f"fail {bad} {_num(self.fail)}")
        return ", ".join(parts) or "-"


def _num(value: float) -> str:
    return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"


def _perf(expected: float, unit: str, warn: float = 0.8, fail: float = 0.5) -> Limit:
    return Limit(warn=expected * warn, fail=expected * fail, unit=unit, expected=expected)


# Expected figures of one healthy device: (bf16 matmul TFLOP/s, fp32 matmul TFLOP/s, device memory copy
# GB/s counting bytes read + written, intra-node all-reduce bus bandwidth GB/s at the largest message).
# Peaks they derive from: H100 SXM 989 bf16 / 67 fp32 / 3.35 TB/s HBM3; H200 the same compute with
# 4.8 TB/s HBM3e; A100 SXM 312 / 19.5 / 2.0 TB/s; MI300X 1307 / 163 (matrix fp32) / 5.3 TB/s; MI325X
# 1307 / 163 / 6 TB/s; MI355X 2517 / 157 / 8 TB/s. Achieved dense GEMM is ~70-85% of peak on NVIDIA and
# ~45-55% on AMD Instinct with hipBLASLt; copies reach ~80-85% of the HBM figure.
_GPU_EXPECTED: dict[str, tuple[float, float, float, float]] = {
    "h200": (720.0, 50.0, 4000.0, 350.0),
    "h100": (700.0, 50.0, 2800.0, 350.0),
    "a100": (260.0, 18.0, 1700.0, 200.0),
    "mi355x": (1400.0, 85.0, 6400.0, 350.0),
    "mi325x": (650.0, 90.0, 4800.0, 300.0),
    "mi300x": (600.0, 90.0, 4200.0, 300.0),
}

# Health and balance limits shared by every GPU type.
_GPU_COMMON: dict[str, Limit] = {
    "disk_write_mbps": Limit(warn=1000.0, fail=200.0, unit="MB/s"),
    "disk_free_gib": Limit(warn=200.0, fail=50.0, unit="GiB"),
    "gpu_temperature_c": Limit(warn=85.0, fail=95.0, higher_is_better=False, unit="C"),
    # enforced power limit over the board's default: a capped device is slow for the whole job
    "power_cap_fraction": Limit(warn=0.95, fail=0.8, unit="x"),
    "ecc_uncorrectable": Limit(warn=None, fail=0.0, higher_is_better=False, unit="errors"),
    "ecc_correctable": Limit(warn=0.0, fail=None, higher_is_better=False, unit="errors"),
    "retired_pages": Limit(warn=0.0, fail=63.0, higher_is_better=False, unit="pages"),
    "row_remap_pending": Limit(warn=0.0, fail=None, higher_is_better=False, unit="rows"),
    "row_remap_failed": Limit(warn=None, fail=0.0, higher_is_better=False, unit=""),
    # how much slower one rank is than its peers (median / its own); 1.0 is perfectly even
    "compute_straggler_ratio": Limit(warn=1.1, fail=1.25, higher_is_better=False, unit="x"),
    "slow_rank_ratio": Limit(warn=1.15, fail=1.3, higher_is_better=False, unit="x"),
}

# CPU ranks share the host's cores (one thread each when several run on a node), so the floors are
# absolute and low, and the balance limits loose: a busy host's scheduling noise alone moves them.
_CPU: dict[str, Limit] = {
    "matmul_bf16_tflops": Limit(warn=0.002, fail=0.0005, unit="TFLOP/s"),
    "matmul_fp32_tflops": Limit(warn=0.005, fail=0.001, unit="TFLOP/s"),
    "memory_bandwidth_gbps": Limit(warn=2.0, fail=0.5, unit="GB/s"),
    "disk_write_mbps": Limit(warn=50.0, fail=10.0, unit="MB/s"),
    "disk_free_gib": Limit(warn=5.0, fail=1.0, unit="GiB"),
    "all_reduce_busbw_gbps": Limit(warn=0.1, fail=0.01, unit="GB/s"),
    "all_gather_busbw_gbps": Limit(warn=0.1, fail=0.01, unit="GB/s"),
    "compute_straggler_ratio": Limit(warn=1.6, fail=2.5, higher_is_better=False, unit="x"),
    "slow_rank_ratio": Limit(warn=1.6, fail=2.5, higher_is_better=False, unit="x"),
}


def _gpu_table(bf16: float, fp32: float, membw: float, busbw: float) -> dict[str, Limit]:
    return {
        "matmul_bf16_tflops": _perf(bf16, "TFLOP/s"),
        "matmul_fp32_tflops": _perf(fp32, "TFLOP/s"),
        "memory_bandwidth_gbps": _perf(membw, "GB/s"),
        "all_reduce_busbw_gbps": _perf(busbw, "GB/s", warn=0.6, fail=0.25),
        "all_gather_busbw_gbps": _perf(busbw, "GB/s", warn=0.6, fail=0.25),
        **_GPU_COMMON,
    }


TABLE: dict[str, dict[str, Limit]] = {
    **{name: _gpu_table(*figures) for name, figures in _GPU_EXPECTED.items()},
    # A GPU not in the table: health and balance are judged, and bf16 matmul against the datasheet peak
    # when models/flops.py knows the device (device_limits); other throughput is reported, not graded.
    "gpu": dict(_GPU_COMMON),
    "cpu": _CPU,
}

CHECK_NAMES: tuple[str, ...] = tuple(sorted({name for limits in TABLE.values() for name in limits}))
UNITS: dict[str, str] = {name: limit.unit for limits in TABLE.values() for name, limit in limits.items()}
# Of the datasheet's dense bf16 peak, what a healthy device of a type we have no figures for should reach
# in the matmul check: the low end of what current GPUs achieve (AMD Instinct ~45-55%, NVIDIA ~70-85%).
UNKNOWN_GPU_BF16_FRACTION = 0.45


def device_type(device_name: str, is_gpu: bool) -> str:
    """The table row for a device, from its torch name (`NVIDIA H100 80GB HBM3`, `AMD Instinct MI300X`)."""
    from phalanx.models.flops import device_key  # here: config validation imports this module, not torch

    if not is_gpu:
        return "cpu"
    return device_key(device_name, _GPU_EXPECTED) or "gpu"


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, float]:
    """`--threshold NAME=VALUE` sets the failure limit of a check, `NAME.warn=VALUE` its warning limit."""
    overrides: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        name, _, which = key.partition(".")
        if not sep or not name:
            raise PhalanxError(f"--threshold takes NAME=VALUE (e.g. matmul_fp32_tflops=40), not {item!r}")
        if name not in CHECK_NAMES:
            close = difflib.get_close_matches(name, CHECK_NAMES, n=1)
            hint = f"; did you mean {close[0]}?" if close else f" (checks: {', '.join(CHECK_NAMES)})"
            raise PhalanxError(f"--threshold: unknown check {name!r}{hint}")
        if which not in ("", "warn", "fail"):
            raise PhalanxError(f"--threshold {key}: the suffix may be .warn or .fail, not .{which}")
        try:
            number = float(value)
        except ValueError:
            raise PhalanxError(f"--threshold {key} takes a number, not {value!r}") from None
        if math.isnan(number):
            raise PhalanxError(f"--threshold {key} takes a number, not {value!r}")
        overrides[f"{name}.{which or 'fail'}"] = number
    return overrides


def config_overrides(thresholds: dict[str, float]) -> dict[str, float]:
    """`safe.preflight_thresholds` as parse_overrides reads them, errors naming that key."""
    try:
        return parse_overrides([f"{k}={v}" for k, v in thresholds.items()])
    except PhalanxError as exc:
        raise PhalanxError(str(exc).replace("--threshold", "safe.preflight_thresholds")) from None


def device_limits(device_name: str, is_gpu: bool, overrides: dict[str, float] | None = None) -> dict[str, Limit]:
    """The limits for one device by its torch name: its type's row, overrides applied."""
    from phalanx.models.flops import peak_tflops

    kind = device_type(device_name, is_gpu)
    limits = limits_for(kind, overrides)
    peak = peak_tflops(device_name) if kind == "gpu" else None
    overridden = any(key.startswith("matmul_bf16_tflops.") for key in overrides or {})
    if peak and not overridden:
        limits["matmul_bf16_tflops"] = _perf(peak * UNKNOWN_GPU_BF16_FRACTION, "TFLOP/s")
    return limits


def limits_for(kind: str, overrides: dict[str, float] | None = None) -> dict[str, Limit]:
    """The limits of one device type with the overrides applied. An override of a check the type does
    not grade (e.g. throughput on an unknown GPU) adds it with that limit only."""
    limits = dict(TABLE[kind])
    for key, value in (overrides or {}).items():
        name, which = key.split(".")
        template = next(table[name] for table in TABLE.values() if name in table)
        limit = limits.get(name, Limit(None, None, template.higher_is_better, template.unit))
        if which == "fail":
            # a failure limit stricter than the warning one leaves no warning zone
            stricter = limit.warn is None or (value > limit.warn if limit.higher_is_better else value < limit.warn)
            limit = replace(limit, fail=value, warn=value if stricter and limit.warn is not None else limit.warn)
        else:
            limit = replace(limit, warn=value)
        limits[name] = limit
    return limits
