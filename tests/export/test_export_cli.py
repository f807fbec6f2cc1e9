"""`phalanx export` refuses bad input with one line and exit code 2, before loading anything."""

from __future__ import annotations

from tests.helpers import phalanx


def refused(*args: str) -> str:
    proc = phalanx("export", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_missing_run_dir(tmp_path):
    line = refused(str(tmp_path / "nope"), "--format", "hf", "--out", str(tmp_path / "out"))
    assert "run directory not found" in line and "nope" in line
    assert not (tmp_path / "out").exists()


def test_unknown_format_and_dtype(tmp_path):
    assert "unknown --format 'onnx'; choose one of hf, gguf" in refused(
        str(tmp_path), "--format", "onnx", "--out", str(tmp_path / "out")
    )
    assert "unknown --dtype 'int4'" in refused(
        str(tmp_path), "--format", "gguf", "--dtype", "int4", "--out", str(tmp_path / "out")
    )


def test_existing_out_is_refused_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    line = refused(str(run), "--format", "hf", "--out", str(out))
    assert "already exists and is not empty; pass --force" in line
    assert (out / "keep.txt").read_text() == "mine"


def test_directory_without_checkpoint(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    line = refused(str(run), "--format", "gguf", "--out", str(tmp_path / "out"))
    assert "has no checkpoint yet" in line
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
