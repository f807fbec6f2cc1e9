"""Live hardware telemetry from the node agent: each accelerator and the host, every few seconds.

Accelerators are read as the preflight reads them (phalanx/parallel/device_health.py): through `pynvml`
(nvidia-ml-py) on NVIDIA or `amdsmi` on AMD, both optional; without them devices are not sampled
(torch could read their memory, but only by opening a GPU context in the agent). The host (CPU, RAM,
disk at the run directory) comes from psutil. Samples go to RUN_DIR/telemetry.jsonl and the node's
/metrics; crossing an alert threshold is one `telemetry_alert` event per crossing.
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
from rich.console import Console

from phalanx.config.schema import ObserveSection
from phalanx.parallel.device_health import read_health
from phalanx.run.jsonl import append_line, json_safe
from phalanx.run.layout import RunDir
from phalanx.run.records import EventSink

DEVICE_FIELDS = (
    "utilization_ratio",
    "memory_used_bytes",
    "memory_total_bytes",
    "temperature_c",
    "power_w",
    "ecc_uncorrectable",
)
# An alert re-arms only once its reading is back this far inside the limit (a fraction of the limit),
# so a reading hovering at the limit (cached GPU memory near full) is one alert, not one per sample.
REARM_MARGIN = 0.02


def device_sample() -> list[dict[str, Any]]:
    """This job's accelerators (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES respected) through the vendor
    library, as the preflight reads them; none without one."""
    import torch  # build metadata only: telling ROCm from CUDA opens no GPU context

    health = read_health(gpu=True, rocm=torch.version.hip is not None)
    visible = os.environ.get("HIP_VISIBLE_DEVICES" if torch.version.hip else "CUDA_VISIBLE_DEVICES")
    devices = health["devices"]
    if visible and all(part.strip().isdigit() for part in visible.split(",")):
        wanted = {int(part) for part in visible.split(",")}
        devices = [d for d in devices if d["index"] in wanted]
    out = []
    for d in devices:
        used, total = d.get("memory_used_bytes"), d.get("memory_total_bytes")
        out.append(
            {
                "device": d["index"],
                **{k: d.get(k) for k in DEVICE_FIELDS},
                "memory_ratio": used / total if used is not None and total else None,
            }
        )
    return out


def host_sample(path: Path) -> dict[str, Any]:
    memory, disk = psutil.virtual_memory(), psutil.disk_usage(str(path))
    return {
        "cpu_ratio": psutil.cpu_percent(interval=None) / 100,
        "memory_used_bytes": memory.total - memory.available,
        "memory_total_bytes": memory.total,
        "disk_free_bytes": disk.free,
        "load1": os.getloadavg()[0],
    }


class TelemetrySampler:
    """A thread in the node agent; `latest` feeds /metrics."""

    def __init__(self, run_dir: Path, observe: ObserveSection, events: EventSink):
        self.run_dir, self.observe, self.events = Path(run_dir), observe, events
        self.node = socket.gethostname()
        self.latest: dict[str, Any] = {}
        self._alerting: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="phalanx-telemetry", daemon=True)
        psutil.cpu_percent(interval=None)  # the first reading only starts psutil's CPU window

    def start(self) -> TelemetrySampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        warned = False
        while not self._stop.wait(self.observe.telemetry_interval_s):
            try:
                self.sample()
            except Exception as exc:  # telemetry must never take the node agent down
                if not warned:
                    Console(stderr=True).print(f"[yellow]warning:[/] telemetry sample failed: {exc}")
                    warned = True

    def sample(self) -> dict[str, Any]:
        record = {"time": time.time(), "node": self.node, "host": host_sample(self.run_dir), "devices": device_sample()}
        self.latest = record
        self._check_alerts(record)  # first: a full disk must still raise its alert
        append_line(RunDir(self.run_dir).telemetry, json.dumps(json_safe(record)))
        return record

    def _check_alerts(self, record: dict[str, Any]) -> None:
        """An event when a reading crosses its threshold; again only after it has come back."""
        o, host = self.observe, record["host"]
        readings = [
            (
                "host_memory_ratio",
                None,
                host["memory_used_bytes"] / host["memory_total_bytes"],
                o.alert_host_memory_ratio,
            ),
            ("disk_free_gib", None, -host["disk_free_bytes"] / 2**30, -o.alert_disk_free_gib),
        ]
        for d in record["devices"]:
            if d.get("temperature_c") is not None:
                readings.append(("device_temperature_c", d["device"], d["temperature_c"], o.alert_device_temp_c))
            if d.get("memory_ratio") is not None:
                readings.append(("device_memory_ratio", d["device"], d["memory_ratio"], o.alert_device_memory_ratio))
            if d.get("ecc_uncorrectable"):
                readings.append(("device_ecc_uncorrectable", d["device"], d["ecc_uncorrectable"], 0))
        for metric, device, value, limit in readings:
            key = f"{metric}:{device}"
            # Lower-is-worse readings (free disk) are negated above so that every check is `value > limit`.
            if value > limit and key not in self._alerting:
                self._alerting.add(key)
                self.events.emit(
                    "telemetry_alert", metric=metric, device=device, value=abs(value), threshold=abs(limit)
                )
            elif value <= limit - REARM_MARGIN * abs(limit):
                self._alerting.discard(key)
