"""Live hardware telemetry from the node agent: each accelerator and the host, every few seconds.

Devices are read through the vendor libraries where present: `pynvml` (nvidia-ml-py) on NVIDIA,
`amdsmi` on AMD, both optional and imported lazily (amdsmi raises KeyError, not ImportError, where ROCm
is absent, so every probe is guarded with `except Exception`). Without them devices are not sampled:
torch could read their memory, but only by opening a GPU context in the agent on every device. The host (CPU, RAM, disk at the run directory) comes from psutil. Samples go to
RUN_DIR/telemetry.jsonl and the node's /metrics; crossing an alert threshold is a `telemetry_alert`
event, once per crossing.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from phalanx.config.schema import ObserveSection
from phalanx.safe.events import EventSink
from phalanx.train.metrics import json_safe

TELEMETRY_FILE = "telemetry.jsonl"


class DeviceProbe:
    """Per-accelerator readings through whichever vendor library works here (or none)."""

    def __init__(self) -> None:
        self.kind, self._handles = "none", []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.kind = "nvml"
            return
        except Exception:
            pass
        try:
            import amdsmi

            amdsmi.amdsmi_init()
            self._amd = amdsmi
            self._handles = amdsmi.amdsmi_get_processor_handles()
            self.kind = "amdsmi"
        except Exception:
            pass

    def sample(self) -> list[dict[str, Any]]:
        if self.kind == "nvml":
            return [self._nvml_sample(i, h) for i, h in enumerate(self._handles)]
        if self.kind == "amdsmi":
            return [self._amd_sample(i, h) for i, h in enumerate(self._handles)]
        return []

    def _nvml_sample(self, index: int, handle: Any) -> dict[str, Any]:
        nv, out = self._nvml, {"device": index}
        out.update(_try(lambda: {"utilization_ratio": nv.nvmlDeviceGetUtilizationRates(handle).gpu / 100}))
        out.update(_try(lambda: _memory(nv.nvmlDeviceGetMemoryInfo(handle).used,
                                        nv.nvmlDeviceGetMemoryInfo(handle).total)))
        out.update(_try(lambda: {"temperature_c": nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)}))
        out.update(_try(lambda: {"power_w": nv.nvmlDeviceGetPowerUsage(handle) / 1000}))
        out.update(_try(lambda: {"ecc_uncorrected": nv.nvmlDeviceGetTotalEccErrors(
            handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)}))
        return out

    def _amd_sample(self, index: int, handle: Any) -> dict[str, Any]:
        amd, out = self._amd, {"device": index}
        out.update(_try(lambda: {"utilization_ratio": amd.amdsmi_get_gpu_activity(handle)["gfx_activity"] / 100}))
        out.update(_try(lambda: _memory(
            amd.amdsmi_get_gpu_memory_usage(handle, amd.AmdSmiMemoryType.VRAM),
            amd.amdsmi_get_gpu_memory_total(handle, amd.AmdSmiMemoryType.VRAM))))
        out.update(_try(lambda: {"temperature_c": amd.amdsmi_get_temp_metric(
            handle, amd.AmdSmiTemperatureType.HOTSPOT, amd.AmdSmiTemperatureMetric.CURRENT)}))
        out.update(_try(lambda: {"power_w": amd.amdsmi_get_power_info(handle)["current_socket_power"]}))
        out.update(_try(lambda: {"ecc_uncorrected": amd.amdsmi_get_gpu_total_ecc_count(handle)["uncorrectable_count"]}))
        return out


def host_sample(path: Path) -> dict[str, Any]:
    memory, disk = psutil.virtual_memory(), psutil.disk_usage(str(path))
    return {"cpu_ratio": psutil.cpu_percent(interval=None) / 100, "memory_used_bytes": memory.total - memory.available,
            "memory_total_bytes": memory.total, "disk_free_bytes": disk.free, "load1": os.getloadavg()[0]}


class TelemetrySampler:
    """A thread in the node agent; `latest` feeds /metrics."""

    def __init__(self, run_dir: Path, observe: ObserveSection, events: EventSink):
        self.run_dir, self.observe, self.events = Path(run_dir), observe, events
        self.node = socket.gethostname()
        self.probe = DeviceProbe()
        self.latest: dict[str, Any] = {}
        self._alerting: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="phalanx-telemetry", daemon=True)
        psutil.cpu_percent(interval=None)  # the first reading only starts psutil's CPU window

    def start(self) -> "TelemetrySampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.observe.telemetry_interval_s):
            self.sample()

    def sample(self) -> dict[str, Any]:
        record = {"time": time.time(), "node": self.node, "host": host_sample(self.run_dir),
                  "devices": self.probe.sample()}
        self.latest = record
        _append_line(self.run_dir / TELEMETRY_FILE, json.dumps(json_safe(record)))
        self._check_alerts(record)
        return record

    def _check_alerts(self, record: dict[str, Any]) -> None:
        """An event when a reading crosses its threshold; again only after it has come back."""
        o, host = self.observe, record["host"]
        readings = [("host_memory_ratio", None, host["memory_used_bytes"] / host["memory_total_bytes"],
                     o.alert_host_memory_ratio),
                    ("disk_free_gib", None, -host["disk_free_bytes"] / 2**30, -o.alert_disk_free_gib)]
        for d in record["devices"]:
            if d.get("temperature_c") is not None:
                readings.append(("device_temperature_c", d["device"], d["temperature_c"], o.alert_device_temp_c))
            if d.get("memory_ratio") is not None:
                readings.append(("device_memory_ratio", d["device"], d["memory_ratio"], o.alert_device_memory_ratio))
            if d.get("ecc_uncorrected"):
                readings.append(("device_ecc_uncorrected", d["device"], d["ecc_uncorrected"], 0))
        for metric, device, value, limit in readings:
            key = f"{metric}:{device}"
            # Lower-is-worse readings (free disk) are negated above so that every check is `value > limit`.
            if value > limit and key not in self._alerting:
                self._alerting.add(key)
                self.events.emit("telemetry_alert", metric=metric, device=device, value=abs(value),
                                 threshold=abs(limit))
            elif value <= limit:
                self._alerting.discard(key)


def _append_line(path: Path, line: str) -> None:
    # One write() with O_APPEND: agents of several nodes may share the file on a shared file system.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _memory(used: float, total: float) -> dict[str, Any]:
    return {"memory_used_bytes": used, "memory_total_bytes": total, "memory_ratio": used / total if total else None}


def _try(read) -> dict[str, Any]:
    """A reading the device or driver does not support is left out, never fatal."""
    try:
        return read()
    except Exception:
        return {}
