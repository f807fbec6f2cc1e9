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


def test_a_launch_refused_by_the_lock_never_removes_the_winners_run_directory(tiny_args, runs_root, monkeypatch):
    """Two launches of one run at once, the loser's first look at the directory stale (as on a slow
    shared filesystem): the loser is refused, and the winner's directory, lock included, stays."""
    import pytest

    from phalanx.config.loader import load_config
    from phalanx.errors import PhalanxError
    from phalanx.job.fresh_run_dir import owned_run_dir

    config = load_config(None, tiny_args)
    run = RunDir(config.run_dir)
    winner_saw_nothing = type(run.path).exists
    monkeypatch.setattr(
        type(run.path), "exists", lambda p: False if p == run.path else winner_saw_nothing(p)
    )  # the stale look
    with run_lock(run.path) as made:  # the winner: it created the directory and holds it
        assert made
        (run.path / "config.yaml").write_text("the winner's\n")
        with pytest.raises(PhalanxError, match="is in use"):
            with owned_run_dir(config):
                pass
        assert run.lock.exists() and (run.path / "config.yaml").read_text() == "the winner's\n"
