"""Preparation that scales: the corpus cut into units, tokenised by 1 or 2 worker processes into parts,
put back together into the same bytes as one process reading it straight through; an interrupted
preparation resumes from its finished parts; bad input in a unit stops it with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import phalanx.data.prepare as prepare_module
from phalanx.data.prepare import PreparedData, prepare_data
from phalanx.data.prepare_progress import progress_line
from phalanx.data.tokenizer import train_tokenizer
from phalanx.errors import PhalanxError
from tests.data.prepare_helpers import UNIT_BYTES, WORDS, make_corpus, shard_hashes, straight_through

VAL = 0.07


@pytest.fixture
def small_units(monkeypatch):
    """Units of 4 KB, and worker processes however little there is to tokenise."""
    monkeypatch.setattr(prepare_module, "UNIT_BYTES", UNIT_BYTES)
    monkeypatch.setattr(prepare_module, "POOL_MIN_BYTES", 0)


def prepare(tmp_path, cache: str, tokenizer=None, **kwargs) -> PreparedData:
    return prepare_data(["corpus"], tmp_path, tmp_path / cache, 400, tokenizer, VAL, **kwargs)


@pytest.fixture
def own_tokenizer(tmp_path) -> str:
    """A tokenizer given, so that no sample is read to train one: bad input is met by the units."""
    train_tokenizer([" ".join(WORDS)] * 3, vocab_size=300).save(str(tmp_path / "own.json"))
    return "own.json"


def manifest(data: PreparedData) -> dict:
    return json.loads((data.dir / "manifest.json").read_text())


def test_one_and_two_workers_write_the_bytes_of_one_straight_read(tmp_path, small_units):
    make_corpus(tmp_path / "corpus")
    one = prepare(tmp_path, "one", workers=1)
    two = prepare(tmp_path, "two", workers=2)
    assert one.dir.name == two.dir.name  # workers are not in the key
    assert shard_hashes(one) == shard_hashes(two)
    reference = straight_through(one, tmp_path / "corpus", VAL, tmp_path / "reference")
    assert {k: v for k, v in shard_hashes(one).items() if k != "tokenizer.json"} == reference
    m1, m2 = manifest(one), manifest(two)
    assert m1["file_tokens"] == m2["file_tokens"] and m1["documents"] == m2["documents"] == 2 + 1500 + 100 + 400
    # the .jsonl is cut into byte ranges and the Parquet file into its 8 row groups: dozens of units
    assert (m2["preparation"]["workers"], m2["preparation"]["reused_units"]) == (2, 0)
    assert m2["preparation"]["units"] > 2 + 8 + 1 + 10
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [two.dir.name]  # the parts are gone


def test_an_interrupted_preparation_resumes_from_its_finished_parts(tmp_path, small_units, monkeypatch):
    make_corpus(tmp_path / "corpus")
    reference = prepare(tmp_path, "reference", workers=1)

    def crash(index):
        if index == 5:
            raise KeyboardInterrupt  # as Ctrl-C or a kill would stop it, after six parts went in

    monkeypatch.setattr(prepare_module, "_unit_merged", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path, "cache", workers=2)
    (staging,) = [p for p in (tmp_path / "cache").iterdir()]  # no temp dir, no prepared dir: the parts
    assert staging.name.startswith(".parts-") and (staging / "tokenizer.json").is_file()
    finished = sorted(p.name for p in staging.glob("part-*.json"))
    assert len(finished) >= 6 and "part-000005.json" in finished

    monkeypatch.setattr(prepare_module, "_unit_merged", lambda index: None)
    monkeypatch.setattr(prepare_module, "train_tokenizer", lambda *a: pytest.fail("trained the tokenizer again"))
    resumed = prepare(tmp_path, "cache", workers=2)
    assert manifest(resumed)["preparation"]["reused_units"] == len(finished)
    assert shard_hashes(resumed) == shard_hashes(reference)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [resumed.dir.name]


def test_bad_input_in_a_later_unit_is_one_line_naming_the_file_and_line(tmp_path, small_units, own_tokenizer):
    corpus = make_corpus(tmp_path / "corpus")
    lines = (corpus / "b.jsonl").read_text().splitlines(keepends=True)
    lines[1200] = '{"text": "cut off\n'  # line 1201, far into the file: its number is counted on error
    (corpus / "b.jsonl").write_text("".join(lines))
    with pytest.raises(PhalanxError, match=rf"^{corpus / 'b.jsonl'}:1201: invalid JSON \("):
        prepare(tmp_path, "cache", own_tokenizer, workers=2)
    lines[1200] = '{"body": "no text"}\n'
    (corpus / "b.jsonl").write_text("".join(lines))
    with pytest.raises(PhalanxError, match=rf"^{corpus / 'b.jsonl'}:1201: no 'text' field"):
        prepare(tmp_path, "cache", own_tokenizer, workers=2)
    assert list((tmp_path / "cache").iterdir()) == []  # bad input: nothing kept to resume


def test_a_null_in_a_later_row_group_names_its_row(tmp_path, small_units, own_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "corpus").mkdir()
    texts = ["some words here"] * 300
    texts[233] = None
    pq.write_table(pa.table({"text": texts}), tmp_path / "corpus" / "d.parquet", row_group_size=50)
    with pytest.raises(PhalanxError, match=r"d\.parquet:row 234: field 'text' is null, expected a string"):
        prepare(tmp_path, "cache", own_tokenizer, workers=2)


def test_a_big_jsonl_of_blank_lines_holds_no_records(tmp_path, small_units, own_tokenizer):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("some text")
    (tmp_path / "corpus" / "blank.jsonl").write_text("\n" * (3 * UNIT_BYTES))
    with pytest.raises(PhalanxError, match=r"blank\.jsonl holds no records"):
        prepare(tmp_path, "cache", own_tokenizer, workers=2)


def test_workers_below_one_are_refused(tmp_path):
    make_corpus(tmp_path / "corpus")
    with pytest.raises(PhalanxError, match="data.workers must be at least 1, got 0"):
        prepare(tmp_path, "cache", workers=0)


def test_the_command_line_refuses_bad_input_in_one_line_with_exit_code_2(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    (corpus / "e.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    command = [sys.executable, "-m", "phalanx", "data", "prepare", "data.sources=[corpus]", "data.workers=2"]
    command += [f"run.dir={tmp_path / 'runs'}", "data.vocab_size=300"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip().splitlines()[-1] == f"error: {corpus / 'e.jsonl'}:2: field 'text' is int, expected a string"
    )


def test_progress_shows_units_tokens_per_second_and_the_time_left():
    assert progress_line(0, 40, 0, 0, 1000, 0.0) == "tokenising: 0/40 units"
    # 2 MB and 500k tokens in 4 s, 6 MB to go: 12 s left
    line = progress_line(10, 40, 500_000, 2_000_000, 6_000_000, 4.0)
    assert line == "tokenising: 10/40 units, 125.0k tokens/s, 0.5 MB/s, ETA 0:00:12"


KILLED_AT_UNIT_5 = """
import os, signal, sys
from pathlib import Path
import phalanx.data.prepare as prepare
from tests.data.prepare_helpers import UNIT_BYTES
prepare.UNIT_BYTES, prepare.POOL_MIN_BYTES = UNIT_BYTES, 0
def killed(index):
    if index == 5:
        os.kill(os.getpid(), signal.SIGKILL)  # no finally, no clean-up: as the OOM killer or a lost node
prepare._unit_merged = killed
if __name__ == "__main__":
    root = Path(sys.argv[1])
    prepare.prepare_data(["corpus"], root, root / "cache", 400, None, 0.07, workers=2)
"""


def test_a_killed_preparation_resumes_from_its_finished_parts(tmp_path, small_units):
    make_corpus(tmp_path / "corpus")
    (tmp_path / "killed.py").write_text(KILLED_AT_UNIT_5)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, tmp_path / "killed.py", tmp_path], env=env, capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr.decode()
    (staging,) = (tmp_path / "cache").glob(".parts-*")
    finished = len(list(staging.glob("part-*.json")))
    assert finished >= 6
    resumed = prepare(tmp_path, "cache", workers=2)
    assert manifest(resumed)["preparation"]["reused_units"] == finished
    assert shard_hashes(resumed) == shard_hashes(prepare(tmp_path, "reference", workers=1))
