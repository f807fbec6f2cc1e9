"""Every command that writes into a run directory takes its lock, or refuses while someone holds it."""

from __future__ import annotations

from phalanx.run.layout import RunDir
from phalanx.run.lock import run_lock
from tests.helpers import phalanx


def test_data_prepare_refuses_a_live_run_and_leaves_its_config(tiny_args, runs_root):
    name = next(a.split("=", 1)[1] for a in tiny_args if a.startswith("run.name="))
    run = RunDir(runs_root / name)
    phalanx("data", "prepare", *tiny_args, "--json")
    before = run.config.read_text()
    with run_lock(run.path):  # what a live `phalanx train` holds for its whole launch
        proc = phalanx("data", "prepare", *tiny_args, "train.lr=0.05", check=False)
    assert proc.returncode == 2 and "is in use by a running `phalanx train`" in proc.stderr
    assert run.config.read_text() == before  # the live run's config was not rewritten
    phalanx("data", "prepare", *tiny_args, "train.lr=0.05", "--json")  # once free, it goes ahead
    assert "lr: 0.05" in run.config.read_text()
