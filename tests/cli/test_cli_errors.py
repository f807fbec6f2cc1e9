"""Bad input: one clear line on stderr, exit code 2, no traceback (unless --debug)."""

import pytest

from tests.helpers import phalanx, train_json


def fails(*args: str) -> str:
    proc = phalanx(*args, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    # One error line, last; before it at most the lines that say what train was doing (preparing data).
    assert lines and lines[-1].startswith("error: "), proc.stderr
    assert all(line.startswith(("preparing data for ", "data: ")) for line in lines[:-1]), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[-1]


def test_misspelt_key_names_it_and_the_right_one():
    line = fails("train", "train.max_step=5")
    assert "train.max_step" in line and "train.max_steps" in line


@pytest.mark.slow
def test_missing_config_and_missing_data(tmp_path):
    assert "config file not found" in fails("train", str(tmp_path / "nope.yaml"))
    assert "not found" in fails("train", f"data.sources=[{tmp_path / 'missing.txt'}]", f"run.dir={tmp_path}")


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("   \n")
    assert "corpus is empty" in fails(
        "data", "prepare", f"data.sources=[{tmp_path / 'empty.txt'}]", f"run.dir={tmp_path}"
    )


def test_vocabulary_too_small(tiny_args):
    assert "vocab" in fails("data", "prepare", *tiny_args, "data.vocab_size=100")


@pytest.mark.slow
def test_batch_sizes_that_do_not_divide(tiny_args):
    assert "multiple of" in fails("train", *tiny_args, "train.global_batch_size=6", "train.micro_batch_size=4")
    # 8 sequences over 2 ranks of micro-batch 3: caught before any rank starts
    line = fails("train", *tiny_args, "train.micro_batch_size=8", "--nproc", "2")
    assert "2 data-parallel ranks" in line


@pytest.mark.slow
def test_checkpoint_from_another_model_shape(tiny_args):
    train_json(*tiny_args, "train.max_steps=2")
    line = fails("train", *tiny_args, "train.max_steps=4", "model.dim=32", "model.ffn_dim=96")
    assert "different model shape" in line and "dim 64 != 32" in line


@pytest.mark.slow
def test_corrupt_checkpoint_named_explicitly(tiny_args):
    summary = train_json(*tiny_args, "train.max_steps=2")
    from pathlib import Path

    for f in Path(summary["last_checkpoint"]).glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])
    line = fails("train", *tiny_args, "train.max_steps=4", f"checkpoint.resume={summary['last_checkpoint']}")
    assert "cannot be trusted" in line and "manifest says" in line


def test_generate_without_a_trained_run(tmp_path):
    assert "nothing does not exist" in fails("generate", str(tmp_path / "nothing"), "hi")
    assert "no checkpoint yet" in fails("generate", str(tmp_path), "hi")


def test_strategy_none_with_several_processes(tiny_args):
    assert "strategy=none" in fails("train", *tiny_args, "parallel.strategy=none", "--nproc", "2")


@pytest.mark.parametrize("preset", ["13b"])
def test_unknown_model_preset(preset):
    assert "preset" in fails("bench", preset)


def test_debug_shows_the_traceback():
    proc = phalanx("--debug", "train", "train.max_step=5", check=False)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


@pytest.mark.parametrize(
    "launch, message",
    [
        (["--rdzv-endpoint", "localhost:abc", "--nnodes", "2"], "--rdzv-endpoint must be HOST:PORT"),
        (["--nnodes", "2:1"], "--nnodes must be N or MIN:MAX"),
        (["--nnodes", "2"], "several nodes need --rdzv-endpoint"),
        (["--rdzv-conf", "last_call_timeout=abc"], "takes whole seconds"),
        (["--rdzv-conf", "endpoint=x"], "unknown option 'endpoint'"),
    ],
)
def test_bad_launch_options(tiny_args, launch, message):
    assert message in fails("train", *tiny_args, *launch)


def test_elastic_range_must_fit_every_size(tiny_args):
    line = fails(
        "train",
        *tiny_args,
        "train.global_batch_size=12",
        "train.micro_batch_size=4",
        "--nnodes",
        "1:3",
        "--rdzv-endpoint",
        "127.0.0.1:29999",
    )
    assert "2 data-parallel ranks" in line  # 12 fits 1 and 3 ranks of 4, not 2


def test_what_ranks_would_refuse_is_one_line_from_the_launcher(tiny_args):
    assert "exceeds the model's max_seq_len" in fails("train", *tiny_args, "train.seq_len=128")
    assert "smaller than the tokenizer" in fails("train", *tiny_args, "model.vocab_size=100")


@pytest.mark.slow
def test_unusable_paths(tiny_args, tmp_path):
    (tmp_path / "a-file").write_text("x")
    assert "cannot create run directory" in fails("train", *tiny_args, f"run.dir={tmp_path / 'a-file'}")
    assert "not a phalanx checkpoint" in fails("train", *tiny_args, f"checkpoint.resume={tmp_path / 'a-file'}")
    (tmp_path / "latin1.yaml").write_bytes("train:\n  lr: 0.1 # caf\xe9\n".encode("latin-1"))
    assert "not UTF-8" in fails("config", "show", str(tmp_path / "latin1.yaml"))
    assert "belongs in a config file" in fails("config", "show", "extends=demo")


def test_one_launch_per_run_directory(tiny_args, runs_root):
    import fcntl

    name = next(a for a in tiny_args if a.startswith("run.name=")).split("=", 1)[1]
    (runs_root / name).mkdir(parents=True, exist_ok=True)
    with open(runs_root / name / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert "in use by a running `phalanx train`" in fails("train", *tiny_args)


@pytest.mark.slow
def test_sigterm_stops_the_ranks_and_exits_143(tiny_args, runs_root):
    import signal
    import subprocess
    import sys
    import time

    name = next(a for a in tiny_args if a.startswith("run.name=")).split("=", 1)[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "train", *tiny_args, "train.max_steps=100000", "checkpoint.interval=100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = runs_root / name / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count('"loss"') >= 3) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143
    assert err.strip().splitlines()[-1].startswith("error: stopped by SIGTERM")
    assert "Traceback" not in err


def test_sigterm_before_the_ranks_start_is_one_line_and_exit_143(tiny_args, runs_root):
    """A scheduler's SIGTERM while the job prepares its data (before the launcher takes signals over) ends
    it through its clean-up, as Ctrl-C does: one line, exit 143, and no run directory it had just made."""
    import signal
    import subprocess
    import sys

    name = next(a for a in tiny_args if a.startswith("run.name=")).split("=", 1)[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "train", *tiny_args, f"run.name={name}-sigterm"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = proc.stderr.readline()
    while seen and not seen.startswith("preparing data"):
        seen = proc.stderr.readline()
    assert seen.startswith("preparing data")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    lines = err.strip().splitlines()
    assert lines[-1] == "error: stopped by SIGTERM; the same command starts it again", err
    assert "Traceback" not in err and sum(line.startswith("error:") for line in lines) == 1
    assert not (runs_root / f"{name}-sigterm").exists()
