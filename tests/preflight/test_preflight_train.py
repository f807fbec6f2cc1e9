"""`safe.preflight` in `phalanx train`: a failing node is named and kept out, quarantine holds across
launches until cleared, and a restart preflights the node again before its ranks return."""

from __future__ import annotations

import socket

import pytest

from phalanx.observe.store import RunStore
from phalanx.run.records import read_events
from tests.helpers import phalanx, train_json

NODE = socket.gethostname()


@pytest.mark.slow
def test_a_node_failing_preflight_does_not_train_and_stays_out_until_cleared(tiny_args, tmp_path):
    args = [*tiny_args, f"run.dir={tmp_path}"]
    # No CPU reaches 10^6 TFLOP/s in fp32: the preflight fails this node before any rank trains.
    failed = phalanx(
        "train", *args, "safe.preflight=quick", "safe.preflight_thresholds={matmul_fp32_tflops: 1e6}", check=False
    )
    assert failed.returncode == 6, failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: preflight failed, the job does not start:") and NODE in last
    assert "matmul_fp32_tflops" in last and "Traceback" not in failed.stderr
    run_dir = tmp_path / tiny_args[-1].split("=", 1)[1]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    assert [e["kind"] for e in read_events(run_dir)] == ["preflight_failed"]

    # Quarantined in the store: a later launch on this node is refused even without preflight.
    refused = phalanx("train", *args, check=False)
    assert refused.returncode == 6
    assert f"node {NODE} is quarantined" in refused.stderr and "phalanx preflight --clear" in refused.stderr

    phalanx("preflight", f"run.dir={tmp_path}", "--clear", NODE)
    assert train_json(*args)["steps"] == 12


@pytest.mark.slow
def test_a_restart_preflights_the_node_again(tiny_args):
    summary = train_json(
        *tiny_args, "safe.preflight=quick", "safe.inject=[{fault: kill, rank: 1, step: 6}]", "--nproc", "2"
    )
    assert summary["steps"] == 12 and summary["restarts"] == 1
    kinds = [(e["kind"], e.get("before")) for e in read_events(summary["run_dir"])]
    start, restart = kinds.index(("preflight_passed", None)), kinds.index(("preflight_passed", "restart"))
    assert start < kinds.index(("restart", None)) < restart < len(kinds) - 1
    store = RunStore.open(None, tiny_args_root(tiny_args), create=False)
    assert [p["passed"] for p in store.preflights()][-2:] == [True, True]


def tiny_args_root(tiny_args: list[str]) -> str:
    return next(a.split("=", 1)[1] for a in tiny_args if a.startswith("run.dir="))


def test_unknown_threshold_keys_in_config_are_one_line_errors(tiny_args):
    proc = phalanx("train", *tiny_args, "safe.preflight_thresholds={matmul_fp33_tflops: 1}", check=False)
    assert proc.returncode == 2
    assert "matmul_fp33_tflops" in proc.stderr and "did you mean matmul_fp32_tflops" in proc.stderr
