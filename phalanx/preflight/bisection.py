"""Finding a slow rank or node by bisecting the group.

A slow rank slows every collective it is part of, and everyone in it waits, so a whole-group timing
cannot say who is to blame. Bisection can: split the group in two halves (along node boundaries while
it spans several nodes), time an all-reduce inside each half, and compare their bus bandwidths (which,
unlike times, do not depend on how many ranks a half has). If one half is clearly slower, recurse into
it; if the halves are even, the slowness is not in one place. The halves take turns, sample by sample,
the other half waiting at a barrier: run at the same time they would compete for shared links, host
cores and the network, and whichever half the scheduler favoured would look faster.

At the end (a group of 2 or 3 ranks) halves would be single ranks, which cannot time a collective
alone. There the late rank gives itself away: in a collective everyone waits for the last to arrive,
so the late rank spends the least time inside the call and its peers the most. If the peers wait
clearly longer than it does, that rank is named; otherwise (a slow link between two ranks looks the
same from both ends) the whole small group is.

Every rank takes part in every step (dist.new_group must be called by all ranks, in the same order), and
all decisions are made from all-gathered figures, so every rank walks the same path.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from phalanx.preflight.collectives import busbw_gbps, collective_op, message_bytes, time_collective
from phalanx.preflight.timing import Timer


@dataclass
class Bisection:
    suspects: list[int] = field(default_factory=list)  # ranks to blame; empty: no slow place found
    ratio: float = 1.0  # how many times longer collectives take with the suspects than without
    levels: list[dict[str, Any]] = field(default_factory=list)
    leaf: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"suspects": self.suspects, "ratio": self.ratio, "levels": self.levels, "leaf": self.leaf}


def halves(group: list[int], node_of: dict[int, int]) -> tuple[list[int], list[int]]:
    """Split by nodes while the group spans several, else by ranks; both halves keep rank order."""
    nodes = sorted({node_of[r] for r in group})
    if len(nodes) > 1:
        first = set(nodes[: len(nodes) // 2])
        return [r for r in group if node_of[r] in first], [r for r in group if node_of[r] not in first]
    middle = len(group) // 2
    return group[:middle], group[middle:]


def find_slow_ranks(
    timer: Timer,
    rank: int,
    world: int,
    node_of: dict[int, int],
    nbytes: int,
    warmup: int,
    samples: int,
    reps: int,
    threshold: float,
) -> Bisection:
    """Bisect the world group for a place that slows collectives by `threshold` times or more."""
    result = Bisection()
    group = list(range(world))
    while True:
        a, b = halves(group, node_of)
        if min(len(a), len(b)) < 2:
            if len(group) > 1:
                _leaf(timer, rank, world, group, nbytes, warmup, samples, reps, threshold, result)
            return result
        # A half that looks slow is measured again: a burst of background load can slow one turn, but
        # it will not pick the same half twice in a row the way a slow rank does.
        level = _compare_halves(timer, rank, world, a, b, nbytes, warmup, samples, reps)
        if level["ratio"] >= threshold:
            again = _compare_halves(timer, rank, world, a, b, nbytes, warmup, samples, reps)
            same = again["slow"] == level["slow"]
            level = {**level, "ratio": min(level["ratio"], again["ratio"]) if same else 1.0, "again": again}
        result.levels.append(level)
        slow, ratio = level["slow"], level["ratio"]
        if ratio < threshold:
            if not result.suspects:
                result.ratio = ratio
            return result  # even halves: the slowness (if any) is the whole group found so far
        group, result.suspects, result.ratio = slow, slow, ratio


def _compare_halves(
    timer: Timer, rank: int, world: int, a: list[int], b: list[int], nbytes: int, warmup: int, samples: int, reps: int
) -> dict[str, Any]:
    every = _gather(_probe_halves(timer, rank, a, b, nbytes, warmup, samples, reps), world)
    bw = {}
    for name, half in (("a", a), ("b", b)):
        size = message_bytes("all_reduce", nbytes, len(half))
        bw[name] = busbw_gbps("all_reduce", size, max(every[r] for r in half), len(half))
    slow = a if bw["a"] < bw["b"] else b
    return {
        "a": a,
        "b": b,
        "a_busbw_gbps": bw["a"],
        "b_busbw_gbps": bw["b"],
        "slow": slow,
        "ratio": max(bw.values()) / min(bw.values()),
        "seconds": {r: every[r] for r in a + b},
    }


def _probe_halves(
    timer: Timer, rank: int, a: list[int], b: list[int], nbytes: int, warmup: int, samples: int, reps: int
) -> float | None:
    """This rank's median all-reduce time inside its half; the halves take turns (alternating which
    goes first), so each is timed alone under the same background load."""
    group_a, group_b = dist.new_group(a), dist.new_group(b)  # every rank creates both, in this order
    half = 0 if rank in a else 1 if rank in b else None
    op = None
    if half is not None:
        members = (a, b)[half]
        op = collective_op("all_reduce", nbytes, timer.device, (group_a, group_b)[half], len(members))
    times, previous = [], None
    for i in range(warmup + samples):
        for turn in (0, 1) if i % 2 == 0 else (1, 0):
            dist.barrier()
            if half == turn:
                previous = timer.sample(op, reps, collective=True, previous=previous)
                if i >= warmup:
                    times.append(previous)
    return statistics.median(times) if times else None


def _leaf(
    timer: Timer,
    rank: int,
    world: int,
    group: list[int],
    nbytes: int,
    warmup: int,
    samples: int,
    reps: int,
    threshold: float,
    result: Bisection,
) -> None:
    """Within a small group, the rank its peers wait for (confirmed by a second round, as halves are)."""
    sub = dist.new_group(group) if len(group) < world else None
    late, lateness, seconds = _lateness(timer, rank, world, group, sub, nbytes, warmup, samples, reps)
    result.leaf = {"ranks": group, "seconds": seconds, "late": late, "ratio": lateness}
    if lateness >= threshold:
        again = _lateness(timer, rank, world, group, sub, nbytes, warmup, samples, reps)
        lateness = min(lateness, again[1]) if again[0] == late else 1.0
        result.leaf.update(ratio=lateness, again={"late": again[0], "ratio": again[1], "seconds": again[2]})
    if lateness >= threshold:
        result.suspects, result.ratio = [late], lateness
    elif not result.levels:
        result.ratio = lateness  # the whole job is this small group and nobody is late: even


def _lateness(
    timer: Timer,
    rank: int,
    world: int,
    group: list[int],
    sub: dist.ProcessGroup | None,
    nbytes: int,
    warmup: int,
    samples: int,
    reps: int,
) -> tuple[int, float, dict[int, float]]:
    """The rank that spends least time inside the group's all-reduce, and how many times longer its
    peers spend there (the median peer)."""
    seconds = None
    if rank in group:
        seconds = time_collective(timer, "all_reduce", nbytes, sub, len(group), warmup, samples, reps)
    every = _gather(seconds, world)
    inside = {r: every[r] for r in group}
    late = min(inside, key=inside.get)
    peers = statistics.median(t for r, t in inside.items() if r != late)
    return late, peers / inside[late] if inside[late] > 0 else float("inf"), inside


def _gather(value: float | None, world: int) -> list[float | None]:
    every: list[float | None] = [None] * world
    dist.all_gather_object(every, value)
    return every
