"""How much work each measurement does: sized for the device (GPU or CPU) and the mode (quick or full).

Sizes are large enough that a healthy device is measured at its real rate (an 8192^3 bf16 matmul keeps
a datacenter GPU's matrix units saturated; a 1 GiB copy is far past any cache) and small enough that
`--quick` stays well under a minute per node.
"""

from __future__ import annotations

from dataclasses import dataclass

KiB, MiB, GiB = 2**10, 2**20, 2**30


@dataclass(frozen=True)
class Workload:
    matmul_n: int  # square matrices n x n
    matmul_samples: int
    matmul_reps: int
    copy_bytes: int  # size of the buffer copied device to device
    copy_samples: int
    disk_bytes: int  # file written and fsynced at the runs directory
    collective_bytes: tuple[int, ...]  # message sizes, as nccl-tests counts them (see collectives.py)
    collective_samples: int
    collective_reps: int  # operations per timed sample: a device sync per operation would dwarf small ones
    probe_bytes: int  # the message of the slow-rank bisection's probes
    probe_samples: int
    probe_reps: int
    warmup: int


def workload(gpu: bool, quick: bool) -> Workload:
    if gpu:
        if quick:
            return Workload(
                matmul_n=8192,
                matmul_samples=5,
                matmul_reps=5,
                copy_bytes=1 * GiB,
                copy_samples=5,
                disk_bytes=256 * MiB,
                collective_bytes=(1 * MiB, 64 * MiB, 256 * MiB),
                collective_samples=10,
                collective_reps=5,
                probe_bytes=64 * MiB,
                probe_samples=10,
                probe_reps=2,
                warmup=3,
            )
        return Workload(
            matmul_n=8192,
            matmul_samples=20,
            matmul_reps=10,
            copy_bytes=2 * GiB,
            copy_samples=20,
            disk_bytes=2 * GiB,
            collective_bytes=(1 * MiB, 16 * MiB, 128 * MiB, 1 * GiB),
            collective_samples=20,
            collective_reps=5,
            probe_bytes=128 * MiB,
            probe_samples=20,
            probe_reps=2,
            warmup=5,
        )
    # On CPUs several ranks share the cores and the scheduler hands them out in slices of a few ms: a
    # sample must span several slices (repeated operations) or its time is mostly which rank ran first.
    if quick:
        return Workload(
            matmul_n=512,
            matmul_samples=5,
            matmul_reps=8,
            copy_bytes=32 * MiB,
            copy_samples=5,
            disk_bytes=32 * MiB,
            collective_bytes=(64 * KiB, 1 * MiB),
            collective_samples=8,
            collective_reps=4,
            probe_bytes=1 * MiB,
            probe_samples=10,
            probe_reps=8,
            warmup=2,
        )
    return Workload(
        matmul_n=768,
        matmul_samples=10,
        matmul_reps=4,
        copy_bytes=128 * MiB,
        copy_samples=10,
        disk_bytes=256 * MiB,
        collective_bytes=(64 * KiB, 1 * MiB, 8 * MiB),
        collective_samples=15,
        collective_reps=4,
        probe_bytes=1 * MiB,
        probe_samples=20,
        probe_reps=8,
        warmup=3,
    )
