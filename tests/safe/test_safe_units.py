"""The safety pieces on their own: heartbeats, hang limits, numerics guard, manifests, stacks, goodput."""

import os
import signal
import time

import pytest

from phalanx.config.schema import SafeSection
from phalanx.run.checkpoints import newest_valid_checkpoint, verify_checkpoint, write_manifest
from phalanx.safe.goodput import account
from phalanx.safe.heartbeat import ENV_FILE, Beat, Heartbeat, HeartbeatBoard
from phalanx.safe.numerics import NumericsGuard
from phalanx.safe.stacks import innermost_frame, register_stack_dump
from phalanx.safe.watchdog import HangDetector


def test_heartbeats_travel_through_the_shared_file(tmp_path, monkeypatch):
    board = HeartbeatBoard(tmp_path / "hb", local_world_size=2)
    monkeypatch.setenv(ENV_FILE, str(tmp_path / "hb"))
    rank1 = Heartbeat(local_rank=1)
    rank1.beat("forward", 7)
    beats = board.read()
    assert beats[0].time == 0.0 and beats[0].phase == "start"  # rank 0 has not beaten
    assert (beats[1].step, beats[1].phase, beats[1].pid) == (7, "forward", os.getpid())
    assert abs(beats[1].time - time.monotonic()) < 1.0
    rank1.step_done(7, 0.25)
    assert board.read()[1].last_step_seconds == 0.25
    board.clear()
    assert board.read()[1].step == 0
    board.close()
    assert not (tmp_path / "hb").exists()
    Heartbeat(local_rank=0, enabled=False).beat("data", 1)  # off: a no-op, no file needed


def beat(rank=0, step=10, phase="forward", when=100.0, last=0.1):
    return Beat(rank, step, phase, 1234, when, last)


def test_hang_limits_by_phase_and_calibration():
    safe = SafeSection(
        hang_floor_s=2, hang_multiplier=10, startup_timeout_s=50, eval_timeout_s=40, checkpoint_timeout_s=30
    )
    detector = HangDetector(safe)
    assert detector.limit(beat(phase="start")) == 50
    assert detector.limit(beat(last=0.0)) == 50  # no step finished yet in this attempt
    assert detector.limit(beat(phase="eval")) == 40 and detector.limit(beat(phase="checkpoint")) == 30
    assert detector.step_timeout() == 50  # too few steps seen to calibrate
    for step in range(1, 7):
        detector.check([beat(step=step, when=100.0 + step, last=0.5)], now=100.0 + step)
    assert detector.step_timeout() == 5.0  # 10 x the 0.5 s steps, above the 2 s floor
    detector.step_times.clear()
    for step in range(1, 7):
        detector.check([beat(step=step, last=0.01)], now=100.0)
    assert detector.step_timeout() == 2  # the floor
    assert HangDetector(SafeSection(hang_timeout_s=7)).step_timeout() == 7


def test_hang_check_reports_every_rank_once_one_is_late():
    detector = HangDetector(SafeSection(hang_timeout_s=5))
    detector.reset(now=0.0)
    fine = [beat(0, when=98.0), beat(1, when=99.0)]
    assert detector.check(fine, now=100.0) == []
    stalls = detector.check([beat(0, when=90.0), beat(1, phase="collective", when=99.0)], now=100.0)
    assert [(s.local_rank, round(s.stalled_for), s.phase) for s in stalls] == [(0, 10, "forward"), (1, 1, "collective")]
    assert detector.check([beat(0, phase="done", when=1.0)], now=100.0) == []  # finished ranks never hang
    never_started = Beat(0, 0, "start", 0, 0.0, 0.0)
    detector.reset(now=0.0)
    assert detector.check([never_started], now=700.0)[0].stalled_for == 700.0  # counted from the attempt


def test_numerics_guard():
    guard = NumericsGuard(zscore=6.0, window=100)
    assert guard.check(float("nan"), 1.0) == "nan" and guard.check(2.0, float("inf")) == "inf"
    assert guard.check(50.0, 1.0) is None  # no history yet: no spike judgement
    for i in range(20):
        guard.accept(3.0 + 0.01 * (i % 3))
    assert guard.check(3.02, 1.0) is None
    assert guard.check(2.0, 1.0) is None  # a drop is never a fault
    assert guard.check(4.0, 1.0) == "spike"
    guard.reset()
    assert guard.check(4.0, 1.0) is None


def make_checkpoint(root, step, payload=b"weights" * 1000):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(payload)
    (path / "trainer.json").write_text("{}")
    write_manifest(path)
    return path


def test_manifest_detects_corruption_and_the_previous_checkpoint_is_used(tmp_path):
    old, new = make_checkpoint(tmp_path, 10), make_checkpoint(tmp_path, 20)
    assert verify_checkpoint(new) is None
    data = bytearray((new / "__0_0.distcp").read_bytes())
    data[100] ^= 0xFF
    (new / "__0_0.distcp").write_bytes(bytes(data))
    assert "checksum" in verify_checkpoint(new)
    reported = []
    assert newest_valid_checkpoint(tmp_path, lambda p, why: reported.append((p.name, why))) == old
    assert reported[0][0] == "step_00000020" and (tmp_path / "corrupt-step_00000020").is_dir()
    (old / "trainer.json").unlink()
    assert verify_checkpoint(old) == "trainer.json is missing"
    (old / "manifest.json").write_text("{")
    assert "manifest" in verify_checkpoint(old)


def test_stack_dump_on_signal(tmp_path):
    handle = register_stack_dump(tmp_path / "stacks" / "rank0.txt")
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        dump = (tmp_path / "stacks" / "rank0.txt").read_text()
    finally:
        import faulthandler

        faulthandler.unregister(signal.SIGUSR1)
        handle.close()
    assert "test_safe_units.py" in dump and "test_stack_dump_on_signal" in dump
    assert (
        innermost_frame('Current thread 0x1 (most recent call first):\n  File "/a/b.py", line 3 in f\n')
        == "b.py:3 in f"
    )
    assert innermost_frame("garbage") is None


def test_goodput_buckets_from_events_and_metrics():
    t0 = 1000.0
    events = [
        {"time": t0 + 1, "kind": "attempt_started"},
        {"time": t0 + 5, "kind": "training_started"},
        {"time": t0 + 8, "kind": "checkpoint_saved", "seconds": 0.5},
        {"time": t0 + 12, "kind": "worker_failed", "stalled_for": 0.2},
        {"time": t0 + 12.1, "kind": "restart"},
        {"time": t0 + 12.1, "kind": "attempt_started"},
        {"time": t0 + 15, "kind": "checkpoint_loaded", "seconds": 1.0},
        {"time": t0 + 16, "kind": "training_started"},
        {"time": t0 + 17, "kind": "anomaly", "anomaly": "nan"},
        {"time": t0 + 18, "kind": "straggler", "straggler_rank": 1, "straggler_node": "n1", "score": 0.5},
        {"time": t0 + 19, "kind": "straggler", "straggler_rank": 1, "straggler_node": "n1", "score": 0.4},
        {"time": t0 - 50, "kind": "restart"},  # an earlier launch: not ours
    ]
    metrics = [{"step": 0, "val_loss": 9.0, "eval_seconds": 1.0, "time": t0 + 4}]
    metrics += [{"step": s, "loss": 5.0, "step_seconds": 1.0, "time": t0 + 5 + s} for s in (1, 2, 3)]
    metrics += [{"step": s, "loss": 5.0, "step_seconds": 1.0, "time": t0 + 16 + s} for s in (2, 3, 4)]
    metrics += [{"step": 5, "loss": 5.0, "step_seconds": 1.0, "time": t0 + 21, "skipped": "nan"}]
    report = account(events, metrics, t0, t0 + 25)
    g = report["goodput"]
    assert g["productive"] == 4.0  # steps 1, 2, 3, 4 as finally kept
    assert g["redone"] == 2.0 and g["skipped"] == 1.0  # steps 2 and 3 ran twice
    assert g["eval"] == 1.0 and g["checkpoint_save"] == 0.5 and g["checkpoint_load"] == 1.0
    assert g["startup"] == 4.0  # 5 s to the first step, less the 1 s step-0 evaluation
    assert g["detection"] == 0.2 and g["restart"] == pytest.approx(3.0)  # 12 -> 16, less 1 s of loading
    assert g["other"] == pytest.approx(25 - sum(v for k, v in g.items() if k != "other"))
    assert report["restarts"] == 1 and report["faults"] == {"crash": 1, "nan": 1}
    assert report["stragglers"] == [{"rank": 1, "node": "n1", "score": 0.4, "alerts": 2}]
    assert report["ettr"] == 4.0 / 25
    # A rank out of memory (the agent's worker_failed says so) is counted as what it was, not as a crash.
    oom = {"time": t0 + 20, "kind": "worker_failed", "stalled_for": 0.0, "reason": "out_of_memory"}
    assert account([*events, oom], metrics, t0, t0 + 25)["faults"] == {"crash": 1, "nan": 1, "out_of_memory": 1}


def test_goodput_buckets_never_overlap_when_the_first_attempt_dies_early():
    t0 = 0.0
    events = [
        {"time": 1.0, "kind": "attempt_started"},
        {"time": 6.0, "kind": "worker_failed", "stalled_for": 2.0},  # died before its first step
        {"time": 6.0, "kind": "restart"},
        {"time": 6.0, "kind": "attempt_started"},
        {"time": 10.0, "kind": "training_started"},
    ]
    metrics = [
        {"step": 0, "val_loss": 9.0, "eval_seconds": 1.0, "time": 9.5},
        {"step": 1, "loss": 5.0, "step_seconds": 1.0, "time": 11.0},
    ]
    g = account(events, metrics, t0, 12.0)["goodput"]
    assert g["startup"] == 4.0 and g["detection"] == 2.0 and g["restart"] == 3.0 and g["eval"] == 1.0
    assert sum(g.values()) == pytest.approx(12.0) and g["other"] == pytest.approx(1.0)


def test_the_rank_behind_in_sync_points_is_the_culprit():
    from phalanx.safe.watchdog import Stall, culprit

    waiting = Stall(0, 25, "backward", 3.0, 2.0, progress=101)
    behind = Stall(1, 25, "collective", 2.9, 2.0, progress=100)  # silent a little less, but behind
    assert culprit([waiting, behind]) is behind
    level = [Stall(0, 25, "backward", 3.0, 2.0, 100), Stall(1, 25, "forward", 2.0, 2.0, 100)]
    assert culprit(level).local_rank == 1  # level: the one stuck in its own work
    assert culprit([Stall(0, 24, "data", 1.0, 2.0, 999), Stall(1, 25, "forward", 9.0, 2.0, 1)]).local_rank == 0


def test_stacks_of_live_and_stopped_processes(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from phalanx.safe.stacks import process_state, take_stacks

    child = (
        "import faulthandler, signal, sys, time\n"
        "f = open(sys.argv[1], 'w'); faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)\n"
        "print('ready', flush=True)\nwhile True: time.sleep(0.05)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", child, str(tmp_path / f"rank{i}.txt")], stdout=subprocess.PIPE)
        for i in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == b"ready"
        procs[1].send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(procs[1].pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        started = time.monotonic()
        missing = take_stacks({i: (p.pid, tmp_path / f"rank{i}.txt") for i, p in enumerate(procs)}, wait_seconds=5)
        assert time.monotonic() - started < 4  # a stopped process is not waited for
        assert missing[0] is None and "File" in (tmp_path / "rank0.txt").read_text()
        assert "stopped" in missing[1] and (tmp_path / "rank1.txt").read_text() == missing[1] + "\n"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_retention_keeps_what_explains_a_fault(tmp_path):
    from phalanx.run.layout import RunDir
    from phalanx.run.retention import apply_retention

    run = RunDir(tmp_path)
    run.stacks.mkdir(parents=True)
    for attempt in range(7):
        run.stack_file(attempt, 0).write_text("Thread 0x1 ...\n")
    run.stack_file(6, 1).touch()  # a killed rank's empty file
    for step in (10, 20, 30):
        (run.checkpoints / f"corrupt-step_{step:08d}").mkdir(parents=True)
    (run.checkpoints / "step_00000040").mkdir()
    apply_retention(tmp_path)
    assert sorted(p.name for p in run.stacks.iterdir()) == [f"attempt{a}-rank0.txt" for a in range(2, 7)]
    assert sorted(p.name for p in run.checkpoints.iterdir()) == [
        "corrupt-step_00000020",
        "corrupt-step_00000030",
        "step_00000040",
    ]
