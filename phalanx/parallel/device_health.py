"""Hardware health of a node's GPUs from the vendor library: utilisation, memory, temperature, power and
power cap, ECC error counts, retired (or remapped) memory pages. Read by the preflight and by the node
agent's live telemetry.

Both libraries are optional and imported only here, lazily: `amdsmi` (ships with ROCm) on AMD,
`pynvml` from nvidia-ml-py (`pip install phalanx[nvidia]`) on NVIDIA. Anything may go wrong in them
(amdsmi raises KeyError, not ImportError, where ROCm is absent; counters a board does not support
raise), so every call is guarded and a figure that cannot be read is None: reported as skipped, never
a crash. Without a library (or without GPUs) the health checks are skipped with a note saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FIELDS = (
    "utilization_ratio",
    "memory_used_bytes",
    "memory_total_bytes",
    "temperature_c",
    "power_w",
    "power_cap_fraction",
    "ecc_correctable",
    "ecc_uncorrectable",
    "retired_pages",
    "row_remap_pending",
    "row_remap_failed",
)


def read_health(gpu: bool, rocm: bool) -> dict[str, Any]:
    """{"source", "note", "driver", "devices": [{"index", "name", FIELDS...}]}."""
    if not gpu:
        return {
            "source": None,
            "note": "no GPU on this node: hardware health not checked",
            "driver": None,
            "devices": [],
        }
    reader = _amd if rocm else _nvidia
    try:
        return reader()
    except Exception as exc:  # the library is missing or cannot start (no driver, ROCm absent)
        library = "amdsmi (from the ROCm install)" if rocm else "nvidia-ml-py (pip install phalanx[nvidia])"
        return {
            "source": None,
            "note": f"{library} unavailable ({type(exc).__name__}: {exc}): hardware health not checked",
            "driver": None,
            "devices": [],
        }


def _try(read: Callable[..., Any], *args: Any) -> Any:
    try:
        return read(*args)
    except Exception:
        return None


def _nvidia() -> dict[str, Any]:
    import pynvml as nv

    nv.nvmlInit()
    try:
        devices = []
        for index in range(nv.nvmlDeviceGetCount()):
            devices.append({"index": index, **_nvidia_device(nv, nv.nvmlDeviceGetHandleByIndex(index))})
        return {
            "source": "pynvml",
            "note": None,
            "driver": _text(_try(nv.nvmlSystemGetDriverVersion)),
            "devices": devices,
        }
    finally:
        _try(nv.nvmlShutdown)


def _nvidia_device(nv: Any, h: Any) -> dict[str, Any]:
    power = _try(nv.nvmlDeviceGetPowerUsage, h)  # mW, as the limits below
    limit = _try(nv.nvmlDeviceGetEnforcedPowerLimit, h)
    default = _try(nv.nvmlDeviceGetPowerManagementDefaultLimit, h)
    # pre-Ampere boards retire pages; Ampere and later remap rows instead: (corrected, uncorrected, pending, failed)
    causes = (
        nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
    )
    retired = [_try(nv.nvmlDeviceGetRetiredPages, h, cause) for cause in causes]
    remap = _try(nv.nvmlDeviceGetRemappedRows, h)
    memory = _try(nv.nvmlDeviceGetMemoryInfo, h)
    utilization = _try(nv.nvmlDeviceGetUtilizationRates, h)
    return {
        "name": _text(_try(nv.nvmlDeviceGetName, h)),
        "utilization_ratio": _ratio(getattr(utilization, "gpu", None), 100),
        "memory_used_bytes": _number(getattr(memory, "used", None)),
        "memory_total_bytes": _number(getattr(memory, "total", None)),
        "temperature_c": _number(_try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)),
        "power_w": power / 1000 if _number(power) is not None else None,
        "power_cap_fraction": _ratio(limit, default),
        "ecc_correctable": _number(
            _try(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)
        ),
        "ecc_uncorrectable": _number(
            _try(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
        ),
        "retired_pages": sum(len(pages) for pages in retired) if all(p is not None for p in retired) else None,
        "row_remap_pending": int(bool(remap[2])) if remap else None,
        "row_remap_failed": int(bool(remap[3])) if remap else None,
    }


def _amd() -> dict[str, Any]:
    import amdsmi

    amdsmi.amdsmi_init()
    try:
        devices, driver = [], None
        for index, h in enumerate(amdsmi.amdsmi_get_processor_handles()):
            driver = driver or (_try(amdsmi.amdsmi_get_gpu_driver_info, h) or {}).get("driver_version")
            devices.append({"index": index, **_amd_device(amdsmi, h)})
        return {"source": "amdsmi", "note": None, "driver": driver, "devices": devices}
    finally:
        _try(amdsmi.amdsmi_shut_down)


def _amd_device(amdsmi: Any, h: Any) -> dict[str, Any]:
    ecc = _try(amdsmi.amdsmi_get_gpu_total_ecc_count, h) or {}
    bad_pages = _try(amdsmi.amdsmi_get_gpu_bad_page_info, h)
    cap = _try(amdsmi.amdsmi_get_power_cap_info, h) or {}
    vram = getattr(getattr(amdsmi, "AmdSmiMemoryType", None), "VRAM", None)
    activity = _try(amdsmi.amdsmi_get_gpu_activity, h) or {}
    return {
        "name": (_try(amdsmi.amdsmi_get_gpu_asic_info, h) or {}).get("market_name"),
        "utilization_ratio": _ratio(activity.get("gfx_activity"), 100),
        "memory_used_bytes": _number(_try(amdsmi.amdsmi_get_gpu_memory_usage, h, vram)),
        "memory_total_bytes": _number(_try(amdsmi.amdsmi_get_gpu_memory_total, h, vram)),
        "temperature_c": _amd_temperature(amdsmi, h),
        "power_w": _amd_power(_try(amdsmi.amdsmi_get_power_info, h) or {}),
        "power_cap_fraction": _ratio(cap.get("power_cap"), cap.get("default_power_cap", cap.get("power_cap_default"))),
        "ecc_correctable": _number(ecc.get("correctable_count")),
        # deferred errors are uncorrectable ones not yet consumed: they count as uncorrectable
        "ecc_uncorrectable": _sum(ecc.get("uncorrectable_count"), ecc.get("deferred_count")),
        # older releases answer a sentence ("No bad pages found.") instead of an empty list
        "retired_pages": len(bad_pages) if isinstance(bad_pages, list) else (0 if bad_pages else None),
        "row_remap_pending": None,
        "row_remap_failed": None,
    }


def _amd_temperature(amdsmi: Any, handle: Any) -> float | None:
    """The hottest-spot sensor the board has (HOTSPOT is called JUNCTION in older releases), then EDGE."""
    for sensor in ("HOTSPOT", "JUNCTION", "EDGE"):
        kind = getattr(amdsmi.AmdSmiTemperatureType, sensor, None)
        if kind is None:
            continue
        value = _number(_try(amdsmi.amdsmi_get_temp_metric, handle, kind, amdsmi.AmdSmiTemperatureMetric.CURRENT))
        if value is not None:
            return value / 1000 if value > 1000 else value  # some releases answer millidegrees
    return None


def _amd_power(info: dict[str, Any]) -> float | None:
    """ROCm 7 calls it socket_power; MI300-era releases current_socket_power (average_ on older boards)."""
    for key in ("socket_power", "current_socket_power", "average_socket_power"):
        value = _number(info.get(key))
        if value is not None:
            return value / 1e6 if value > 1e5 else value  # some releases answer microwatts
    return None


def _number(value: Any) -> float | None:
    """Vendor libraries answer "N/A" (or nothing) for counters a board lacks."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _sum(*values: Any) -> float | None:
    numbers = [n for n in map(_number, values) if n is not None]
    return sum(numbers) if numbers else None


def _ratio(top: Any, bottom: Any) -> float | None:
    top, bottom = _number(top), _number(bottom)
    return top / bottom if top is not None and bottom else None


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
