"""Accelerators the planner knows: memory per device and dense bf16 peak, from vendor datasheets.

Memory is the HBM capacity the vendor states, in GiB: the stacks are binary-sized, and the runtime
reports about that (an MI300X shows 192 GiB to torch, an H100 SXM5 79.2 of its 80). The CUDA/ROCm
context, the collective library's buffers and allocator fragmentation come out of the planner's
headroom, not out of these figures.

Peaks come from phalanx.models.flops.PEAK_BF16_TFLOPS (the table the trainer's MFU uses), so a plan's
MFU means the same as the MFU a run reports.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass

from phalanx.errors import PhalanxError
from phalanx.models.flops import peak_tflops


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    peak_tflops: float  # dense bf16 (float32 for `cpu`), one device
    kind: str  # "gpu" (bf16 autocast, nccl) or "cpu" (fp32, gloo); fused AdamW on both (train/optim.py)
    source: str
    # CPU ranks share one host's memory; GPU ranks each have their own device.
    shared_by_ranks: bool = False
    # GB/s one device sends: to a peer in its node (xGMI / NVLink, one direction) and out of the node.
    intra_node_gbps: float = 50.0
    inter_node_gbps: float = 50.0


# name -> (HBM GiB, the torch device-name key of the flops table, datasheet)
_GPUS: dict[str, tuple[float, str, str]] = {
    "mi300x": (192, "mi300x", "AMD Instinct MI300X datasheet: 192 GB HBM3"),
    "mi325x": (256, "mi325x", "AMD Instinct MI325X datasheet: 256 GB HBM3E"),
    "mi350x": (288, "mi350x", "AMD Instinct MI350X datasheet: 288 GB HBM3E"),
    "mi355x": (288, "mi355x", "AMD Instinct MI355X datasheet: 288 GB HBM3E"),
    "a100": (80, "a100", "NVIDIA A100 datasheet: 80 GB HBM2e (SXM4 80GB)"),
    "h100": (80, "h100", "NVIDIA H100 datasheet: 80 GB HBM3 (SXM5)"),
    "h200": (141, "h200", "NVIDIA H200 datasheet: 141 GB HBM3e (SXM)"),
    "b200": (180, "b200", "NVIDIA HGX B200 datasheet: 1,440 GB HBM3e per 8 GPUs"),
}

# Peak one-direction bandwidth per device inside a node (vendor figures: MI300X/MI325X 896 GB/s and
# MI350X/MI355X 1,075 GB/s of Infinity Fabric both ways; NVLink 3/4/5 600/900/1,800 GB/s both ways) and
# across nodes (one 400 Gb/s NIC per GPU, the usual build of these clusters). Collectives reach less.
_LINKS: dict[str, tuple[float, float]] = {
    "mi300x": (448, 50),
    "mi325x": (448, 50),
    "mi350x": (537, 50),
    "mi355x": (537, 50),
    "a100": (300, 25),
    "h100": (450, 50),
    "h200": (450, 50),
    "b200": (900, 50),
}

# A CPU's fp32 peak is not in any table: cores x an AVX2-class 32 FLOP/cycle (two 8-wide FMA units)
# x 2.5 GHz, unless --peak-tflops says better. Only a rough default for tokens/s, never for memory.
CPU_FLOP_PER_CYCLE_PER_CORE = 32
CPU_ASSUMED_GHZ = 2.5


def device_names() -> list[str]:
    return [*_GPUS, "cpu"]


def get_device(name: str, cpu_peak_tflops: float | None = None) -> Device:
    """A device by name (case-insensitive): one of device_names()."""
    key = name.lower()
    if key == "cpu":
        return cpu_device(cpu_peak_tflops)
    if key not in _GPUS:
        close = difflib.get_close_matches(key, device_names(), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise PhalanxError(f"unknown device '{name}': {hint}valid devices are {', '.join(device_names())}")
    memory, flops_key, source = _GPUS[key]
    peak = peak_tflops(flops_key)
    assert peak is not None, f"{flops_key} is missing from phalanx.models.flops.PEAK_BF16_TFLOPS"
    intra, inter = _LINKS[key]
    return Device(key, float(memory), peak, "gpu", source, intra_node_gbps=intra, inter_node_gbps=inter)


def all_devices(cpu_peak_tflops: float | None = None) -> list[Device]:
    return [get_device(name, cpu_peak_tflops) for name in device_names()]


def cpu_device(peak: float | None = None) -> Device:
    """This host: its RAM (shared by every rank on it) and an fp32 peak from the flag or a guess."""
    import psutil

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    guessed = cores * CPU_FLOP_PER_CYCLE_PER_CORE * CPU_ASSUMED_GHZ / 1000
    source = (
        "this host's RAM (psutil); peak from --peak-tflops"
        if peak
        else f"this host's RAM (psutil); peak guessed as {cores} cores x {CPU_FLOP_PER_CYCLE_PER_CORE} "
        f"FLOP/cycle x {CPU_ASSUMED_GHZ} GHz"
    )
    return Device("cpu", psutil.virtual_memory().total / 2**30, peak or guessed, "cpu", source, shared_by_ranks=True)
