"""Bad input: one clear line on stderr, exit code 2, no traceback (unless --debug)."""

import pytest
from helpers import phalanx, train_json


def fails(*args: str) -> str:
    proc = phalanx(*args, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_misspelt_key_names_it_and_the_right_one():
    line = fails("train", "train.max_step=5")
    assert "train.max_step" in line and "train.max_steps" in line


def test_missing_config_and_missing_data(tmp_path):
    assert "config file not found" in fails("train", str(tmp_path / "nope.yaml"))
    assert "not found" in fails("train", f"data.sources=[{tmp_path / 'missing.txt'}]", f"run.dir={tmp_path}")


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("   \n")
    assert "corpus is empty" in fails("data", "prepare", f"data.sources=[{tmp_path / 'empty.txt'}]",
                                      f"run.dir={tmp_path}")


def test_vocabulary_too_small(tiny_args):
    assert "vocab" in fails("data", "prepare", *tiny_args, "data.vocab_size=100")


def test_batch_sizes_that_do_not_divide(tiny_args):
    assert "multiple of" in fails("train", *tiny_args, "train.global_batch_size=6", "train.micro_batch_size=4")
    # 8 sequences over 2 ranks of micro-batch 3: caught before any rank starts
    line = fails("train", *tiny_args, "train.micro_batch_size=8", "--nproc", "2")
    assert "2 data-parallel ranks" in line


def test_checkpoint_from_another_model_shape(tiny_args):
    train_json(*tiny_args, "train.max_steps=2")
    line = fails("train", *tiny_args, "train.max_steps=4", "model.dim=32", "model.ffn_dim=96")
    assert "different model shape" in line and "dim 64 != 32" in line


def test_corrupt_checkpoint_named_explicitly(tiny_args):
    summary = train_json(*tiny_args, "train.max_steps=2")
    from pathlib import Path

    for f in Path(summary["last_checkpoint"]).glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])
    line = fails("train", *tiny_args, "train.max_steps=4", f"checkpoint.resume={summary['last_checkpoint']}")
    assert "cannot be trusted" in line and "manifest says" in line


def test_generate_without_a_trained_run(tmp_path):
    assert "run directory not found" in fails("generate", str(tmp_path / "nothing"), "hi")
    assert "no checkpoint yet" in fails("generate", str(tmp_path), "hi")


def test_strategy_none_with_several_processes(tiny_args):
    assert "strategy=none" in fails("train", *tiny_args, "parallel.strategy=none", "--nproc", "2")


@pytest.mark.parametrize("preset", ["13b"])
def test_unknown_model_preset(preset):
    assert "preset" in fails("bench", preset)


def test_debug_shows_the_traceback():
    proc = phalanx("--debug", "train", "train.max_step=5", check=False)
    assert proc.returncode != 0 and "Traceback" in proc.stderr
