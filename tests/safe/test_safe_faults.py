"""Fault drills through the real launcher: 2 ranks on gloo under the phalanx node agent.

Each injected fault must be detected within its window, the run must reach its last step, and every
step's loss must equal a run without faults (exact resume), as the README promises.
"""

import json
from pathlib import Path

import pytest

from phalanx.run.records import read_events
from tests.helpers import losses_by_step, phalanx, train_json

# 60 steps of 2 ranks, a checkpoint every 10: the shape of the acceptance drill. Restarts resume
# from disk here (no in-memory snapshots): these drills are about the checkpoints a restart falls back on.
DRILL = [
    "train.max_steps=60",
    "train.eval_interval=30",
    "checkpoint.interval=10",
    "checkpoint.keep=10",
    "checkpoint.memory_interval=0",
    "safe.hang_floor_s=2",
    "--nproc",
    "2",
]


def named(args, name):
    return [a for a in args if not a.startswith("run.name=")] + [f"run.name={name}"]


@pytest.fixture(scope="module")
def clean(corpus, runs_root):
    from tests.conftest import TINY

    args = TINY + [f"data.sources=[{corpus}]", f"run.dir={runs_root}", "run.name=drill-clean"]
    summary = train_json(*args, *DRILL)
    return args, summary, losses_by_step(summary["run_dir"])


def drill(clean, name, faults, *extra):
    args, _, clean_losses = clean
    summary = train_json(*named(args, name), *DRILL, f"safe.inject={json.dumps(faults)}", *extra)
    assert summary["steps"] == 60
    assert losses_by_step(summary["run_dir"]) == clean_losses  # every step, bit for bit
    return summary, read_events(Path(summary["run_dir"]))


def kinds(events):
    return [e["kind"] for e in events]


def test_clean_run_has_no_faults(clean):
    _, summary, _ = clean
    assert summary["restarts"] == 0 and summary["faults"] == {} and summary["stragglers"] == []
    assert 0 < summary["ettr"] < 1
    assert set(summary["goodput"]) == {
        "productive",
        "redone",
        "skipped",
        "eval",
        "checkpoint_save",
        "checkpoint_load",
        "startup",
        "detection",
        "restart",
        "other",
    }


def test_kill_rank_restarts_from_checkpoint(clean):
    summary, events = drill(clean, "drill-kill", [{"fault": "kill", "rank": 1, "step": 20}])
    assert summary["restarts"] == 1 and summary["faults"] == {"crash": 1}
    assert summary["ettr"] < 1 and summary["goodput"]["redone"] > 0 and summary["goodput"]["restart"] > 0
    failed = next(e for e in events if e["kind"] == "worker_failed")
    assert failed["rank"] == 1 and failed["exitcode"] == -9 and failed["step"] == 20
    assert failed["stalled_for"] < 1.0  # detected within a few monitoring ticks
    loaded = next(e for e in events if e["kind"] == "checkpoint_loaded")
    assert loaded["step"] == 10  # rank 1 died in step 20's forward, before step 20's save


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["forward", "collective"])
def test_hung_rank_is_found_its_stack_saved_and_run_completes(clean, phase):
    summary, events = drill(clean, f"drill-hang-{phase}", [{"fault": "hang", "rank": 1, "step": 25, "phase": phase}])
    assert summary["restarts"] == 1 and summary["faults"] == {"hang": 1}
    hang = next(e for e in events if e["kind"] == "hang_detected")
    # Rank 0 waits in backward's gradient reduction, a sync point rank 1 never reached (it hangs in its
    # forward, or in a side group's all-reduce): the sync-point counts name rank 1 either way.
    assert hang["rank"] == 1
    assert 2.0 <= hang["stalled_for"] < 3.5  # the 2 s floor applies to these tiny steps
    culprit = next(r for r in hang["ranks"] if r["rank"] == 1)
    assert culprit["step"] == 25 and culprit["phase"] == phase
    stack = Path(culprit["stack_file"]).read_text()
    assert "inject.py" in stack and "_train" not in culprit["where"]
    if phase == "collective":
        assert "all_reduce" in stack  # blocked inside the collective itself
    peer = next(r for r in hang["ranks"] if r["rank"] == 0)
    assert Path(peer["stack_file"]).read_text()  # the waiting rank's stack is kept too
    assert summary["goodput"]["detection"] >= 2.0


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_its_missing_stack_explained(clean):
    summary, events = drill(clean, "drill-stop", [{"fault": "stop", "rank": 1, "step": 25}])
    assert summary["restarts"] == 1 and summary["faults"] == {"hang": 1}
    hang = next(e for e in events if e["kind"] == "hang_detected")
    assert hang["rank"] == 1
    stopped = next(r for r in hang["ranks"] if r["rank"] == 1)
    assert "stopped" in stopped["stack_missing"]
    assert Path(stopped["stack_file"]).read_text().startswith("no stack: process ")  # never an empty file
    peer = next(r for r in hang["ranks"] if r["rank"] == 0)
    assert "stack_missing" not in peer and peer["progress"] > stopped["progress"]


def test_nan_loss_rolls_back_and_replays(clean):
    summary, events = drill(clean, "drill-nan", [{"fault": "nan", "rank": 1, "step": 33}])
    assert summary["restarts"] == 0 and summary["faults"] == {"nan": 1}
    anomaly = next(e for e in events if e["kind"] == "anomaly")
    assert anomaly["step"] == 33 and anomaly["anomaly"] == "nan"
    rollback = next(e for e in events if e["kind"] == "rollback")
    assert rollback["step"] == 33 and rollback["to_step"] == 30
    assert summary["goodput"]["redone"] > 0


@pytest.mark.slow
def test_nan_loss_with_skip_policy_skips_the_update(clean):
    args, _, clean_losses = clean
    faults = json.dumps([{"fault": "nan", "rank": 0, "step": 33}])
    summary = train_json(*named(args, "drill-nan-skip"), *DRILL, f"safe.inject={faults}", "safe.numerics=skip")
    assert summary["steps"] == 60 and summary["faults"] == {"nan": 1}
    losses = losses_by_step(summary["run_dir"])
    assert {s: losses[s] for s in range(1, 33)} == {s: clean_losses[s] for s in range(1, 33)}
    assert losses[34] != clean_losses[34]  # one update fewer from here on
    from tests.helpers import read_metrics

    skipped = [m for m in read_metrics(summary["run_dir"]) if m.get("skipped")]
    assert [(m["step"], m["loss"]) for m in skipped] == [(33, None)]  # NaN is written as JSON null
    assert "step_skipped" in kinds(read_events(Path(summary["run_dir"])))


@pytest.mark.slow
def test_corrupt_newest_checkpoint_is_skipped_for_the_previous(clean):
    faults = [{"fault": "corrupt_checkpoint", "rank": 0, "step": 45}, {"fault": "kill", "rank": 1, "step": 47}]
    summary, events = drill(clean, "drill-corrupt", faults)
    corrupt = next(e for e in events if e["kind"] == "checkpoint_corrupt")
    assert corrupt["path"].endswith("step_00000040") and "checksum" in corrupt["reason"]
    assert next(e for e in events if e["kind"] == "checkpoint_loaded")["step"] == 30
    assert summary["faults"] == {"corrupt_checkpoint": 1, "crash": 1}
    assert (Path(summary["run_dir"]) / "checkpoints" / "corrupt-step_00000040").is_dir()


@pytest.mark.slow
def test_failed_save_is_recorded_and_retried_next_interval(clean):
    summary, events = drill(clean, "drill-fail-save", [{"fault": "fail_save", "rank": 1, "step": 30}])
    failed = next(e for e in events if e["kind"] == "save_failed")
    assert failed["step"] == 30 and "no space left on device" in failed["error"].lower()
    saved = [e["step"] for e in events if e["kind"] == "checkpoint_saved"]
    assert 30 not in saved and 40 in saved and summary["restarts"] == 0
    assert not (Path(summary["run_dir"]) / "checkpoints" / "step_00000030").exists()


@pytest.mark.slow
def test_slow_rank_is_reported_as_straggler(clean):
    summary, events = drill(
        clean, "drill-slow", [{"fault": "slow", "rank": 1, "step": 5, "ms": 150}], "safe.straggler_window=10"
    )
    assert [s["rank"] for s in summary["stragglers"]] == [1]
    assert summary["stragglers"][0]["score"] < 0.75 and summary["stragglers"][0]["node"]
    alerts = [e for e in events if e["kind"] == "straggler"]
    assert alerts and all(e["straggler_rank"] == 1 for e in alerts)
    assert alerts[0]["step"] == 10  # the first window after the slowdown


@pytest.mark.slow
def test_crash_loop_stops_with_its_own_exit_code(clean):
    args, _, _ = clean
    faults = json.dumps([{"fault": "kill", "rank": 1, "step": 3, "repeat": True}])
    proc = phalanx(
        "train",
        *named(args, "drill-crash-loop"),
        *DRILL,
        f"safe.inject={faults}",
        "safe.crash_loop_restarts=2",
        "safe.max_restarts=5",
        check=False,
    )
    assert proc.returncode == 3
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: crash loop: 2 restarts in a row without checkpoint progress")
    assert "rank 1 exited with code -9 at step 3" in last


@pytest.mark.slow
def test_restarts_exhausted_exit_code(clean):
    args, _, _ = clean
    faults = json.dumps([{"fault": "kill", "rank": 0, "step": 15, "repeat": True}])
    proc = phalanx(
        "train", *named(args, "drill-exhausted"), *DRILL, f"safe.inject={faults}", "safe.max_restarts=1", check=False
    )
    assert proc.returncode == 4
    assert proc.stderr.strip().splitlines()[-1].startswith("error: the run failed again after 1 restarts")


@pytest.mark.slow
def test_restart_continues_from_this_launchs_checkpoint_even_with_resume_never(clean):
    summary, events = drill(
        clean, "drill-kill-never", [{"fault": "kill", "rank": 0, "step": 14}], "checkpoint.resume=never"
    )
    assert [e["step"] for e in events if e["kind"] == "checkpoint_loaded"] == [10]
