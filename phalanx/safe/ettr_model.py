"""What a job's ETTR would be at a size no test can run: the goodput accounting turned into a model.

A job of `gpus` devices is interrupted at a rate proportional to its size; Llama 3's 405B pre-training
saw 419 unexpected interruptions in 54 days on 16,384 GPUs, about one per 3.1 hours (Dubey et al.,
2024), which is the default reference. Each interruption costs what the goodput buckets of a drill
measure: the time to detect it, to restart (processes, rendezvous), to load the checkpoint, and the
steps redone since that checkpoint (half an interval on average, for faults that fall uniformly in
time). Checkpointing costs its training stall once per interval. To first order (interruptions rare
against the time one takes to recover):

    ETTR = (1 - rate * (detection + restart + load + interval / 2)) * interval / (interval + stall)

`best_interval` is the Young/Daly interval, sqrt(2 * stall * MTBF), which minimises that loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LLAMA3_GPUS = 16_384
LLAMA3_HOURS_PER_INTERRUPTION = 54 * 24 / 419


@dataclass(frozen=True)
class RecoveryCosts:
    """Seconds, as a drill's goodput report measures them."""

    detection: float
    restart: float
    load: float
    save_stall: float


def interruptions_per_second(
    gpus: int, reference_gpus: int = LLAMA3_GPUS, hours_per_interruption: float = LLAMA3_HOURS_PER_INTERRUPTION
) -> float:
    if gpus < 1:
        raise ValueError(f"a job has at least one GPU, not {gpus}")
    return gpus / reference_gpus / (hours_per_interruption * 3600)


def projected_ettr(costs: RecoveryCosts, interval_seconds: float, gpus: int, **reference) -> float:
    """The fraction of wall time spent on kept training steps; 0 when faults come faster than recovery."""
    if interval_seconds <= 0:
        raise ValueError(f"the checkpoint interval must be positive, not {interval_seconds}")
    rate = interruptions_per_second(gpus, **reference)
    lost_per_fault = costs.detection + costs.restart + costs.load + interval_seconds / 2
    return max(0.0, 1 - rate * lost_per_fault) * interval_seconds / (interval_seconds + costs.save_stall)


def best_interval(costs: RecoveryCosts, gpus: int, **reference) -> float:
    """Young/Daly: the checkpoint interval (seconds of training) with the least expected loss."""
    mtbf = 1 / interruptions_per_second(gpus, **reference)
    return math.sqrt(2 * max(costs.save_stall, 1e-9) * mtbf)
