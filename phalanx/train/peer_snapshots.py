"""Peer copies of in-memory snapshots: each rank's snapshot also lives in a rank on another node.

A rank's own snapshots (memory_checkpoint.py) live in its node's /dev/shm, which a lost node takes with
it. When the job spans more than one node (LOCAL_WORLD_SIZE < WORLD_SIZE; on one node host memory is
shared already and nothing here runs), every sealed snapshot is also sent to rank
(rank + local_world_size) % world_size, on the next node, which keeps the newest KEEP copies it holds
for that source rank in its own launch directory (phalanx/run/snapshots.py's peer_dir): the slot's raw
bytes, then a sidecar written last (the source's own sidecar, CRC-32 included). Nothing loaded is
unpickled or run: the bytes are only ever copied into tensors, after the CRC check.

The copies travel over a gloo process group of their own, created once, on two threads (one sends, one
receives), so a training step never waits for one and the training group's collectives never interleave
with them. A new copy waits for the previous one to be sent (the snapshot writer waits, and so the next
snapshot): copies must keep up with the rank's own snapshots, because a resume needs a step that every
survivor still holds itself (SLOTS, memory_checkpoint.py) and that the lost ranks' peers hold a copy of.
Skipping copies while one is in flight let them fall behind on a loaded machine until no held copy
matched any survivor's own snapshot, and the resume went back to the disk checkpoint (seen in CI). A slow
link so shows up in the snapshot's measured cost (`memory_interval: auto` lengthens the interval); only a
copy still in flight after PATIENCE seconds (a frozen peer) is skipped, so that training never hangs on one.

At resume, every rank counts a step as available when it or its peer holds it; a rank that lacks its
own copy of the agreed step (a replacement node) is sent the one its peer holds, checks its CRC, and
installs it as an ordinary snapshot of its own. A corrupt copy is refused with one line, so the
agreement falls back to an older step or the disk, as for a torn snapshot of its own.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.run.snapshots import (
    complete_steps,
    peer_dir,
    peer_sources,
    sidecar_path,
    write_sidecar,
)

KEEP = 2  # copies held per source rank: the newest, and the one before (a peer may have finished one fewer)
PATIENCE = 30.0  # seconds a new copy waits for the previous one to be sent before it is skipped
STOP = -1


def spans_nodes(world_size: int) -> bool:
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    return dist.is_initialized() and local < world_size


class PeerCopies:
    """Collective to construct (every rank, in the same order): it creates the gloo group."""

    def __init__(self, launch: Path, rank: int, world_size: int, say: Callable[[str], None]):
        self.launch, self.rank, self.world, self.say = launch, rank, world_size, say
        self.local = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
        self.target = self.holder(rank)  # who holds my copies
        self.source = (rank - self.local) % world_size  # whose copies I hold
        self.group = dist.new_group(backend="gloo")
        self._lock = threading.Lock()
        self._next: tuple[int, int, torch.Tensor] | None = None  # (step, slot bytes, slot bytes + sidecar)
        self._wake = threading.Condition(self._lock)
        self._busy = False
        self._closing = False
        self._threads: list[threading.Thread] = []
        self.sent: list[tuple[int, float]] = []  # (step, seconds) of each copy sent, for measurements

    def holder(self, rank: int) -> int:
        return (rank + self.local) % self.world

    # -- sending and receiving, in the background ------------------------------------------------
    def _start(self) -> None:
        if not self._threads:
            for target, name in ((self._send_loop, "send"), (self._recv_loop, "recv")):
                thread = threading.Thread(target=target, name=f"phalanx-peer-{name}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def offer(self, step: int, flat: torch.Tensor, sidecar: dict[str, Any]) -> bool:
        """From the snapshot writer, once `step` is sealed: hand a copy to the sender once the previous
        one is sent (see the module's docstring). Whether it was taken."""
        with self._wake:
            self._start()
            self._wake.wait_for(lambda: not self._busy or self._closing, timeout=PATIENCE)
            if self._busy or self._closing:
                return False
            side = json.dumps(sidecar).encode()
            payload = torch.empty(flat.numel() + len(side), dtype=torch.uint8)
            payload[: flat.numel()].copy_(flat)  # its own buffer: the slot is reused two snapshots later
            payload[flat.numel() :] = torch.frombuffer(bytearray(side), dtype=torch.uint8)
            self._next, self._busy = (step, flat.numel(), payload), True
            self._wake.notify_all()
            return True

    def _send_loop(self) -> None:
        _lower_priority()
        while True:
            with self._wake:
                while self._next is None and not self._closing:
                    self._wake.wait()
                job, self._next = self._next, None
            try:
                if job is None:  # closing: tell the peer's receiver
                    dist.send(torch.tensor([STOP, 0, 0], dtype=torch.int64), self.target, group=self.group)
                    return
                step, nbytes, payload = job
                t0 = time.perf_counter()
                dist.send(
                    torch.tensor([step, nbytes, payload.numel()], dtype=torch.int64), self.target, group=self.group
                )
                dist.send(payload, self.target, group=self.group)
                self.sent.append((step, time.perf_counter() - t0))
            except RuntimeError:  # (DistBackendError) the peer is gone: training fails too, the agent restarts us
                return
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _recv_loop(self) -> None:
        _lower_priority()
        while True:
            header = torch.zeros(3, dtype=torch.int64)
            try:
                dist.recv(header, self.source, group=self.group)
                step, nbytes, total = (int(v) for v in header)
                if step == STOP:
                    return
                payload = torch.empty(total, dtype=torch.uint8)
                dist.recv(payload, self.source, group=self.group)
            except RuntimeError:  # (DistBackendError) the source is gone (its node lost): what we hold for it stays
                return
            try:
                store(
                    peer_dir(self.launch, self.source), step, payload[:nbytes], bytes(payload[nbytes:].numpy()).decode()
                )
            except OSError as exc:  # /dev/shm full: the copy is lost, training goes on
                self.say(
                    f"warning: rank {self.rank}: cannot keep rank {self.source}'s peer copy of step "
                    f"{step} ({exc.strerror or exc})"
                )

    def stop_offers(self) -> None:
        """Take no more copies: a writer waiting to offer one returns at once (the rank is closing)."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()

    def close(self) -> None:
        """Stop both threads (the peer's receiver is told by our sender); nothing is sent after this."""
        if not self._threads:
            return
        with self._wake:  # the sender sends what it holds, then STOP
            self._closing = True
            self._wake.notify_all()
        for thread in self._threads:
            thread.join(timeout=30)
        self._threads = []

    # -- resuming --------------------------------------------------------------------------------
    def fetch(self, own: list[int], newer_than: int) -> tuple[int, torch.Tensor, dict[str, Any]] | None:
        """Collective, before training (the threads not started): the newest step every rank has itself
        or at its peer, newer than `newer_than`; each rank lacking its own copy of it is sent its peer's.
        This rank's received (step, slot bytes, sidecar), CRC-checked, or None."""
        if self._threads:
            return None  # a rollback mid-run: no rank has lost its own snapshots
        held = {source: complete_steps(d) for source, d in peer_sources(self.launch).items()}
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (own, held), group=self.group)
        available = [set(gathered[r][0]) | set(gathered[self.holder(r)][1].get(r, [])) for r in range(self.world)]
        common = [s for s in set.intersection(*available) if s > newer_than]
        if not common:
            return None
        step = max(common)
        needy = [r for r in range(self.world) if step not in gathered[r][0]]
        works, mine = [], None
        for r in needy:
            if self.holder(r) == self.rank:
                try:
                    data, side = load_raw(peer_dir(self.launch, r), step)
                except OSError:  # gone since it was listed: the receiver is told (-1) and falls back
                    works.append(dist.isend(torch.tensor([-1, 0], dtype=torch.int64), r, group=self.group))
                    continue
                header = torch.tensor([data.numel(), len(side.encode())], dtype=torch.int64)
                payload = torch.cat([data, torch.frombuffer(bytearray(side.encode()), dtype=torch.uint8)])
                works += [dist.isend(header, r, group=self.group), dist.isend(payload, r, group=self.group)]
        if self.rank in needy:
            header = torch.zeros(2, dtype=torch.int64)
            dist.recv(header, self.holder(self.rank), group=self.group)
            if int(header[0]) < 0:
                self.say(
                    f"warning: rank {self.rank}: the peer copy of step {step} held by rank "
                    f"{self.holder(self.rank)} is gone; not used"
                )
                for work in works:
                    work.wait()
                return None
            payload = torch.empty(int(header.sum()), dtype=torch.uint8)
            dist.recv(payload, self.holder(self.rank), group=self.group)
            nbytes = int(header[0])
            sidecar = json.loads(bytes(payload[nbytes:].numpy()).decode())
            data = payload[:nbytes]
            if zlib.crc32(memoryview(data.numpy())) != sidecar.get("crc32") or sidecar.get("step") != step:
                self.say(
                    f"warning: rank {self.rank}: the peer copy of step {step} held by rank "
                    f"{self.holder(self.rank)} does not match its CRC-32; not used"
                )
            else:
                mine = (step, data, sidecar)
        for work in works:
            work.wait()
        return mine


def _lower_priority() -> None:
    """Copies yield the cores to training (Linux nice values are per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def store(directory: Path, step: int, data: torch.Tensor, sidecar: str) -> None:
    """Keep a peer copy: its bytes, then its sidecar (last: now it counts); the oldest beyond KEEP go."""
    directory.mkdir(parents=True, exist_ok=True)
    # A step sent again (retrained after a rollback): its old sidecar goes first, so none names torn bytes.
    sidecar_path(directory, step).unlink(missing_ok=True)
    with open(_bytes_path(directory, step), "wb") as f:
        f.write(memoryview(data.numpy()))
    write_sidecar(directory, step, sidecar)
    for old in complete_steps(directory)[:-KEEP]:
        sidecar_path(directory, old).unlink(missing_ok=True)  # the sidecar first: never torn bytes
        _bytes_path(directory, old).unlink(missing_ok=True)


def load_raw(directory: Path, step: int) -> tuple[torch.Tensor, str]:
    """A held copy's bytes and sidecar text, unchecked (the receiver checks the CRC)."""
    side = sidecar_path(directory, step).read_text()
    data = torch.frombuffer(bytearray(_bytes_path(directory, step).read_bytes()), dtype=torch.uint8)
    return data, side


def _bytes_path(directory: Path, step: int) -> Path:
    return sidecar_path(directory, step).with_suffix(".bin")
