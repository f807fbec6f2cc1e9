"""What a node is: its accelerators, software versions, CPU, memory and disk, and where nodes differ.

A job whose nodes run different torch, CUDA/ROCm, collective library or driver versions can hang or
give different numerics on different ranks, so versions that differ between nodes fail the preflight.
Hardware sizes (CPU model, RAM) are reported but may differ.
"""

from __future__ import annotations

import platform
import socket
from collections import Counter
from pathlib import Path
from typing import Any

# Fields that must be equal on every node of a job.
MUST_MATCH = ("python", "torch", "cuda", "hip", "nccl", "driver", "accelerator", "arch", "phalanx")


def collect(runs_root: Path, driver: str | None) -> dict[str, Any]:
    """This node's inventory. `driver` comes from the vendor library when health.py found one."""
    import psutil
    import torch

    import phalanx
    from phalanx.preflight.compute import disk_free_gib

    accelerators = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            # ROCm names the architecture (gfx942); CUDA gives a compute capability (sm_90)
            arch = getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"
            accelerators.append(
                {
                    "index": index,
                    "name": props.name,
                    "memory_gib": props.total_memory / 2**30,
                    "arch": arch,
                    "compute_units": props.multi_processor_count,
                }
            )
    names = sorted({a["name"] for a in accelerators})
    return {
        "host": socket.gethostname(),
        "accelerators": accelerators,
        "accelerator": f"{len(accelerators)} x {', '.join(names)}" if accelerators else "none",
        "arch": ", ".join(sorted({a["arch"].split(":")[0] for a in accelerators})) or None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "nccl": _nccl_version(torch),
        "driver": driver or _driver_from_files(),
        "phalanx": phalanx.__version__,
        "cpu_model": _cpu_model(),
        "cpu_cores": psutil.cpu_count(logical=False) or None,
        "cpu_threads": psutil.cpu_count(logical=True),
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "runs_dir": str(runs_root),
        "disk_free_gib": disk_free_gib(runs_root),
    }


def compare(inventories: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Fields in MUST_MATCH whose values differ between nodes. Each mismatch names the odd nodes: those
    not holding the value most nodes hold; when no value has a strict majority (two nodes, two
    values), nobody can be told apart and `odd` is empty."""
    mismatches = []
    for key in MUST_MATCH:
        values = {node: inv.get(key) for node, inv in inventories.items()}
        counts = Counter(values.values())
        if len(counts) < 2:
            continue
        common, top = counts.most_common(1)[0]
        majority = top > len(values) / 2
        odd = sorted(node for node, value in values.items() if value != common) if majority else []
        mismatches.append({"field": key, "values": values, "odd": odd})
    return mismatches


def _nccl_version(torch) -> str | None:
    """NCCL (RCCL on ROCm) as torch was built with it."""
    try:
        if not torch.cuda.is_available():
            return None
        version = torch.cuda.nccl.version()
        return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception:
        return None


def _driver_from_files() -> str | None:
    """The kernel driver's version without a vendor library: NVIDIA and amdgpu both publish it."""
    nvidia = Path("/proc/driver/nvidia/version")
    try:
        if nvidia.is_file():
            # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..."
            words = nvidia.read_text().split()
            return next((w for w in words if w[:1].isdigit() and w.count(".") >= 1), None)
        amdgpu = Path("/sys/module/amdgpu/version")
        if amdgpu.is_file():
            return amdgpu.read_text().strip() or None
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "cpu model", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
