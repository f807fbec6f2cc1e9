"""What `phalanx train` and the other commands say on the console, from the real commands with stderr
written to a file (not a terminal, as in CI logs, `| tee` or `nohup`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import phalanx, read_metrics, train_json

# torch's own log format (W1201 12:00:00.000000 123 torch/...) and its warnings, hidden unless --debug.
TORCH_LOG_LINE = re.compile(r"^[WEIC]\d{4} \d\d:\d\d:\d\d", re.M)
ESCAPES = re.compile(r"\x1b\[|\r")


def train_to_file(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, check: bool = True
) -> tuple[subprocess.CompletedProcess, str]:
    """`phalanx train ARGS` with stderr to a file; returns the process (stdout captured) and stderr."""
    log = tmp_path / f"stderr-{time.monotonic_ns()}.txt"
    with open(log, "w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "phalanx", "train", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=600,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    text = log.read_text()
    if check:
        assert proc.returncode == 0, text
    return proc, text


def run_name(args: list[str]) -> str:
    return next(a for a in args if a.startswith("run.name=")).split("=", 1)[1]


def test_a_run_says_what_it_does_in_plain_lines(tiny_args, tmp_path):
    _, text = train_to_file(tmp_path, *tiny_args, env={"PHALANX_PROGRESS_INTERVAL": "0"})
    lines = text.splitlines()
    expected = [
        "preparing data for ",
        "data: ",
        "starting 1 rank (one process): ",
        "evaluating at step 0",
        "step 0: val loss ",
        "step 1/12  loss ",
        "step 12/12  loss ",
    ]
    positions = [next((i for i, line in enumerate(lines) if line.startswith(e)), None) for e in expected]
    assert None not in positions and positions == sorted(positions), text
    assert len([line for line in lines if re.match(r"step \d+/12  loss", line)]) == 12  # interval 0: every step
    assert not ESCAPES.search(text) and "Traceback" not in text


@pytest.mark.slow
def test_plain_progress_comes_every_interval_not_every_step(tiny_args, tmp_path):
    _, text = train_to_file(tmp_path, *tiny_args, "train.max_steps=6")  # default interval, 10 s
    progress = [line for line in text.splitlines() if re.match(r"step \d+/6  loss", line)]
    assert progress[0].startswith("step 1/6") and progress[-1].startswith("step 6/6")
    assert len(progress) < 6, text


@pytest.mark.slow
def test_a_restart_is_one_phalanx_line_and_torch_stays_quiet(tiny_args, tmp_path):
    _, text = train_to_file(
        tmp_path,
        *tiny_args,
        "--nproc",
        "2",
        "safe.inject=[{fault: kill, rank: 1, step: 5}]",
        "checkpoint.memory_interval=0",
    )  # a restart from the disk checkpoint of step 4
    assert "rank 1 exited (SIGKILL) at step 5; restarting from step 4 if sound, restart 1 of 3" in text, text
    assert f"resuming from step 4 (checkpoint {tiny_args[-2].split('=', 1)[1]}/{run_name(tiny_args)}" in text
    assert "starting 2 ranks (ddp): " in text
    assert not TORCH_LOG_LINE.search(text) and "FutureWarning" not in text and "closing signal" not in text, text


@pytest.mark.slow
def test_debug_shows_torchs_own_lines(tiny_args, tmp_path):
    _, text = train_to_file(tmp_path, "--debug", *tiny_args, "train.max_steps=2", "--nproc", "2")
    assert "broadcast_buffers" in text  # DDP's FutureWarning, hidden without --debug


@pytest.mark.slow
def test_ctrl_c_is_one_line_with_the_resume_hint(tiny_args, tmp_path, runs_root):
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        # A session of its own: Ctrl-C at a terminal signals the whole foreground group, ranks included.
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "phalanx",
                "train",
                *tiny_args,
                "--nproc",
                "2",
                "train.max_steps=100000",
                "checkpoint.interval=2",
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    metrics = runs_root / run_name(tiny_args) / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and metrics.read_text().count('"loss"') >= 5) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # it did not stop: leave nothing training behind the failure
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert proc.returncode == 130, text
    last = text.strip().splitlines()[-1]
    assert re.match(r"error: stopped by SIGINT \(Ctrl-C\); the same command resumes from step \d+ \(", last), text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text


@pytest.mark.parametrize(
    "args, says",
    [
        (["train", "--nproc", "0"], "Invalid value for '--nproc'"),
        (["train", "--nprc", "2"], "No such option: --nprc"),
        (["plan"], "Missing argument 'CONFIG|PRESET'"),
        (["tarin"], "No such command 'tarin'"),
    ],
)
def test_bad_option_values_are_one_error_line(args, says):
    proc = phalanx(*args, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and says in lines[0] and "--help" in lines[0]


@pytest.mark.slow
def test_a_finished_run_says_so_and_keeps_its_summary(tiny_args, tmp_path):
    first = train_json(*tiny_args, "train.max_steps=3")
    summary_file = Path(first["run_dir"]) / "summary.json"
    saved = summary_file.read_text()
    proc, text = train_to_file(tmp_path, *tiny_args, "train.max_steps=3", "--json")
    assert f"{first['run_dir']} is already at step 3 of 3; nothing to do" in text
    assert json.loads(proc.stdout) == first and first["tokens_per_sec"] is not None
    assert summary_file.read_text() == saved
    assert len([m for m in read_metrics(first["run_dir"]) if "loss" in m]) == 3  # nothing trained again

    proc, text = train_to_file(tmp_path, *tiny_args, "train.max_steps=2", check=False)
    assert proc.returncode == 2 and text.strip().splitlines()[-1].startswith(
        "error: train.max_steps=2 is below the step of the newest checkpoint, 3"
    ), text


@pytest.mark.slow
def test_a_refused_launch_leaves_no_run_directory(tiny_args, tmp_path, runs_root):
    proc = phalanx("train", *tiny_args, "model.vocab_size=100", check=False)  # refused after data prep
    assert proc.returncode == 2 and "smaller than the tokenizer" in proc.stderr
    assert not (runs_root / run_name(tiny_args)).exists()
    fresh_root = tmp_path / "new-runs"
    proc = phalanx(
        "train", *tiny_args, f"run.dir={fresh_root}", f"data.sources=[{tmp_path / 'missing.txt'}]", check=False
    )
    assert proc.returncode == 2 and not fresh_root.exists()
    proc = phalanx("data", "prepare", *tiny_args, f"data.sources=[{tmp_path / 'missing.txt'}]", check=False)
    assert proc.returncode == 2 and not (runs_root / run_name(tiny_args)).exists()


@pytest.mark.slow
def test_the_preflight_drill_says_how_to_clear_its_quarantine(tmp_path):
    proc = phalanx(
        "preflight", f"run.dir={tmp_path}", "--quick", "--nproc", "2", "--inject-slow-rank", "1", check=False
    )
    assert proc.returncode == 6, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    node = re.search(r"this drill quarantined (\S+):", last).group(1)
    assert f"`phalanx preflight --clear {node}` releases it" in last
    assert "released" in phalanx("preflight", f"run.dir={tmp_path}", "--clear", node).stdout


# -- help and tables at 80 columns ------------------------------------------------------------------------
def all_commands() -> list[list[str]]:
    import typer.main

    from phalanx.cli import app

    found = []

    def walk(command, path):
        found.append(path)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, path + [name])

    walk(typer.main.get_command(app), [])
    return found


@pytest.mark.parametrize("path", all_commands(), ids=lambda p: " ".join(p) or "phalanx")
def test_every_help_has_an_example_and_fits_80_columns(path):
    from typer.testing import CliRunner

    from phalanx.cli import app

    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "Example" in result.output, f"phalanx {' '.join(path)} --help has no example"
    assert all(len(line) <= 80 for line in lines) and "…" not in result.output, result.output
    examples = result.output[result.output.index("Example") :].splitlines()[1:]
    for line in (line.strip() for line in examples if line.strip().startswith("phalanx ")):
        assert path == [] or line.split()[1] == path[0], line


@pytest.mark.slow
def test_runs_tables_fit_80_columns(tiny_args, runs_root):
    long_name = [a for a in tiny_args if not a.startswith("run.name=")] + [
        f"run.name={run_name(tiny_args)}-with-a-rather-long-name"
    ]
    train_json(*long_name, "train.max_steps=6", "--nproc", "2", "safe.inject=[{fault: kill, rank: 1, step: 3}]")
    env = {**os.environ, "COLUMNS": "80", "PYTHONUNBUFFERED": "1"}
    for args in (["runs", "list"], ["runs", "show", run_name(long_name)]):
        out = subprocess.run(
            [sys.executable, "-m", "phalanx", *args, "--runs", str(runs_root)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stdout
        assert all(len(line) <= 80 for line in out.splitlines()), out
        assert "…" not in out.split("events")[0], out  # no cell cut short (event details may be, at 160)
        assert '\\"' not in out and '{"' not in out, out  # event details as key/value, not escaped JSON
    listing = subprocess.run(
        [sys.executable, "-m", "phalanx", "runs", "list", "--runs", str(runs_root)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    folded = "".join(line.split()[0] for line in listing.splitlines()[4:] if line.strip())
    assert run_name(long_name) in folded and "finished" in listing  # a long name wraps, whole
