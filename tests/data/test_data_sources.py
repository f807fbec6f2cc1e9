"""Corpus and fine-tuning sources in the formats people keep them: Parquet, gzip and zstd JSON Lines, Hugging
Face datasets saved to disk or named on the hub. Each gives the very tokens the same text gives as plain
files, and each kind of bad input is one line (exit code 2 from the CLI).

No test reaches the hub: HF_HUB_OFFLINE and HF_DATASETS_OFFLINE are set for every test and every process
one starts, and the hub is only ever asked for in order to be refused."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import phalanx.data.readers.optional as optional
import phalanx.data.readers.parquet as parquet_reader
from phalanx.data.corpus import iter_documents, resolve_sources
from phalanx.data.prepare import prepare_data
from phalanx.data.sft import SftOptions
from phalanx.errors import PhalanxError
from tests.conftest import TINY
from tests.helpers import phalanx

datasets = pytest.importorskip("datasets")
zstandard = pytest.importorskip("zstandard")

WORDS = "the king and queen of verona speak softly to a ghost while night falls on elsinore".split()
ONE_LINE = "^[^\n]*$"  # a refusal is one line, never a traceback


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """Twelve documents of different lengths, with a line break and a non-ASCII character or two."""
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, 40 + 25 * i)) + f"\nfin {i} — café\n" for i in range(12)]


# --- writing each format ------------------------------------------------------------------------------


def jsonl_bytes(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def write_txt_dir(dir: Path, docs: list[str]) -> Path:
    dir.mkdir(parents=True)
    for i, doc in enumerate(docs):  # doc00, doc01, ...: sorted as written, so the order is the same
        (dir / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    return dir


def write_parquet(path: Path, records: list[dict], row_group_size: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def write_records(path: Path, records: list[dict]) -> Path:
    """A record file of the type its name says; a directory name without a suffix: save_to_disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    name = path.name
    if name.endswith(".parquet"):
        write_parquet(path, records, row_group_size=5)  # several row groups
    elif name.endswith(".jsonl.gz"):
        path.write_bytes(gzip.compress(jsonl_bytes(records)))
    elif name.endswith(".jsonl.zst"):
        raw = jsonl_bytes(records)  # two frames, as pzstd and `zstd -T` write: the file is all of them
        half = len(raw) // 2
        compress = zstandard.ZstdCompressor().compress
        path.write_bytes(compress(raw[:half]) + compress(raw[half:]))
    elif name.endswith(".jsonl"):
        path.write_bytes(jsonl_bytes(records))
    else:
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


def prepare(tmp_path: Path, sources: list[str], cache: str, **overrides):
    args = dict(vocab_size=300, tokenizer=None, val_fraction=0.1)
    return prepare_data(list(sources), tmp_path, tmp_path / cache, **{**args, **overrides})


def prepared_bytes(data) -> dict[str, bytes]:
    """Everything the tokens are: the tokenizer and every shard, by file name."""
    files = [data.tokenizer_path, *data.shards]
    return {p.name: p.read_bytes() for p in files}


@pytest.fixture(autouse=True)
def quiet_saving():
    datasets.disable_progress_bars()


# --- the same tokens from every format -----------------------------------------------------------------


@pytest.mark.parametrize(
    "written, entry",
    [
        ("corpus.jsonl.gz", "corpus.jsonl.gz"),
        ("corpus.jsonl.zst", "corpus.jsonl.zst"),
        ("corpus.parquet", "corpus.parquet"),
        ("parquet/part-0.parquet", "parquet"),  # a directory of Parquet files
        ("parquet/part-0.parquet", "parquet/*.parquet"),  # a glob
        ("saved", "saved"),  # a dataset saved with save_to_disk
        ("holder/saved", "holder"),  # ... found inside a directory
    ],
)
def test_each_format_prepares_the_tokens_plain_text_gives(tmp_path, documents, written, entry):
    write_txt_dir(tmp_path / "txt", documents)
    write_records(tmp_path / "reference.jsonl", [{"text": d} for d in documents])
    write_records(tmp_path / written, [{"text": d, "id": i} for i, d in enumerate(documents)])
    expected = prepared_bytes(prepare(tmp_path, ["txt"], "cache-txt"))
    assert prepared_bytes(prepare(tmp_path, ["reference.jsonl"], "cache-jsonl")) == expected
    data = prepare(tmp_path, [entry], "cache")
    assert prepared_bytes(data) == expected  # byte for byte: tokenizer, train and val shards
    assert json.loads((data.dir / "manifest.json").read_text())["documents"] == len(documents)


def test_a_text_column_other_than_text_is_read_from_data_text_field(tmp_path, documents):
    write_records(tmp_path / "a.parquet", [{"body": d} for d in documents])
    write_records(tmp_path / "saved", [{"body": d} for d in documents])
    for entry in ("a.parquet", "saved"):
        assert list(iter_documents(resolve_sources([entry], tmp_path), text_field="body")) == documents


def test_a_saved_dataset_changed_in_place_is_prepared_again(tmp_path, documents):
    write_records(tmp_path / "saved", [{"text": d} for d in documents])
    first = prepare(tmp_path, ["saved"], "cache")
    write_records(tmp_path / "saved", [{"text": d} for d in documents[:6]])
    second = prepare(tmp_path, ["saved"], "cache")
    assert second.dir != first.dir and second.train_tokens < first.train_tokens


def test_parquet_is_read_a_row_group_batch_at_a_time_never_whole(tmp_path, monkeypatch):
    """3,000 rows in 6 row groups, read in batches of 100 rows of the text column alone; reading the whole
    table (read, read_table) fails the test."""
    docs = [f"row {i} of many" for i in range(3000)]
    path = write_parquet(tmp_path / "big.parquet", [{"text": d, "meta": "x" * 50} for d in docs], row_group_size=500)
    assert pq.ParquetFile(path).num_row_groups == 6
    seen = []
    real_iter_batches = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        seen.append(kwargs)
        for batch in real_iter_batches(self, *args, **kwargs):
            assert batch.num_rows <= 100
            seen.append(batch.num_rows)
            yield batch

    def whole(*args, **kwargs):
        raise AssertionError("the whole Parquet file was read at once")

    monkeypatch.setattr(parquet_reader, "BATCH_ROWS", 100)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    monkeypatch.setattr(pq, "read_table", whole)
    assert list(iter_documents(resolve_sources(["big.parquet"], tmp_path))) == docs
    assert seen[0] == {"batch_size": 100, "columns": ["text"]}
    assert seen[1:] == [100] * 30


# --- fine-tuning records -------------------------------------------------------------------------------

CHATS = [
    [
        {"role": "user", "content": f"Question {i}: what light through yonder window breaks?"},
        {"role": "assistant", "content": f"It is the east, and Juliet is the sun ({i})."},
    ]
    for i in range(8)
]


@pytest.mark.parametrize("name", ["chat.parquet", "chat.jsonl.gz", "chat.jsonl.zst", "chat-saved"])
def test_chat_records_prepare_as_their_jsonl_does(tmp_path, name):
    records = [{"messages": m} for m in CHATS]
    write_records(tmp_path / "chat.jsonl", records)
    write_records(tmp_path / name, records)
    sft = SftOptions(max_tokens=256)
    expected = prepared_bytes(prepare(tmp_path, ["chat.jsonl"], "cache-jsonl", sft=sft))
    data = prepare(tmp_path, [name], "cache", sft=sft)
    assert prepared_bytes(data) == expected
    assert data.kind == "sft" and data.examples["records"] == len(CHATS)


# --- bad input -----------------------------------------------------------------------------------------


def corrupt_gzip(path: Path) -> Path:
    path.write_bytes(gzip.compress(jsonl_bytes([{"text": "a"}] * 50))[:-20])  # truncated
    return path


@pytest.mark.parametrize(
    "make, entry, message",
    [
        (lambda p: write_parquet(p / "a.parquet", [{"body": "x"}]), "a.parquet", r"a\.parquet: no 'text' column \(it has body\); set data\.text_field"),
        (lambda p: (p / "a.parquet").write_bytes(b"PAR1 not really"), "a.parquet", r"a\.parquet: not a readable Parquet file"),
        (lambda p: write_parquet(p / "a.parquet", [{"text": "ok"}, {"text": "ok"}, {"text": None}]), "a.parquet", r"a\.parquet:row 3: field 'text' is null, expected a string"),
        (lambda p: write_parquet(p / "a.parquet", [{"text": 7}]), "a.parquet", r"a\.parquet:row 1: field 'text' is int, expected a string"),
        (lambda p: pq.write_table(pa.table({"text": pa.array([], pa.string())}), p / "a.parquet"), "a.parquet", r"a\.parquet holds no records"),
        (lambda p: corrupt_gzip(p / "a.jsonl.gz"), "a.jsonl.gz", r"a\.jsonl\.gz: corrupt or truncated compressed data \(Compressed file ended"),
        (lambda p: (p / "a.jsonl.gz").write_bytes(b"plain, not gzip"), "a.jsonl.gz", r"a\.jsonl\.gz: corrupt or truncated compressed data \(Not a gzipped file"),
        (lambda p: (p / "a.jsonl.gz").write_bytes(gzip.compress(b"")), "a.jsonl.gz", r"a\.jsonl\.gz holds no records"),
        (lambda p: (p / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n[1]\n')), "a.jsonl.gz", r"a\.jsonl\.gz:2: no 'text' field"),
        (lambda p: (p / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage"), "a.jsonl.zst", r"a\.jsonl\.zst: corrupt or truncated compressed data"),
        (lambda p: write_records(p / "saved", [{"body": "x"}]), "saved", r"saved: no 'text' column \(it has body\)"),
        (lambda p: datasets.Dataset.from_dict({"text": []}).save_to_disk(str(p / "saved")), "saved", r"saved holds no records"),
        (lambda p: datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "x"}])}).save_to_disk(str(p / "dd")), "dd", r"dd is a saved DatasetDict \(splits: train\); name one split's directory, e\.g\. .*dd/train"),
        (lambda p: None, "hf:a/b/c", r"'hf:a/b/c' is not a hub dataset name: write hf:ORG/NAME, hf:ORG/NAME:SPLIT"),
        (lambda p: None, "hf:org/name:cfg:train:extra", r"is not a hub dataset name"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_the_file_and_what_is_wrong(tmp_path, make, entry, message):
    make(tmp_path)
    with pytest.raises(PhalanxError, match=message) as caught:
        prepare(tmp_path, [entry], "cache")
    assert "\n" not in str(caught.value)


def test_a_missing_package_is_one_line_naming_it(tmp_path, monkeypatch):
    write_records(tmp_path / "a.jsonl.zst", [{"text": "x"}])
    write_records(tmp_path / "saved", [{"text": "x"}])
    monkeypatch.setattr(optional, "available", lambda module: False)
    for entry, module in (("a.jsonl.zst", "zstandard"), ("saved", "datasets"), ("hf:org/name", "datasets")):
        with pytest.raises(PhalanxError, match=f"needs the '{module}' package.*pip install 'phalanx\\[data\\]'"):
            resolve_sources([entry], tmp_path)


def cli_error(tmp_path: Path, source: str) -> str:
    proc = phalanx(
        "data", "prepare", f"data.sources=[{source}]", f"run.dir={tmp_path / 'runs'}", "run.name=bad",
        "data.vocab_size=300", check=False, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_the_cli_refuses_a_hub_dataset_offline_in_one_line(tmp_path):
    line = cli_error(tmp_path, "hf:phalanx-tests/no-such-dataset:validation")
    assert "hf:phalanx-tests/no-such-dataset:validation: cannot stream it from the Hugging Face hub" in line
    assert "save_to_disk" in line


def test_the_cli_refuses_a_bad_row_in_one_line(tmp_path):
    write_records(tmp_path / "a.jsonl.gz", [{"text": "fine"}, {"text": 3.5}])
    line = cli_error(tmp_path, "a.jsonl.gz")
    assert line.endswith("a.jsonl.gz:2: field 'text' is float, expected a string"), line


# --- training ------------------------------------------------------------------------------------------


def test_a_parquet_corpus_trains_through_the_cli(tmp_path, corpus):
    """The conftest corpus, a paragraph a row, in row groups of 200, trains a few steps of the tiny model."""
    paragraphs = [p for p in corpus.read_text().split("\n\n") if p.strip()]
    write_parquet(tmp_path / "plays.parquet", [{"text": p} for p in paragraphs], row_group_size=200)
    proc = phalanx(
        "train", *TINY, f"data.sources=[{tmp_path / 'plays.parquet'}]", f"run.dir={tmp_path / 'runs'}",
        "run.name=parquet", "train.max_steps=2", "train.eval_batches=1", "--json", timeout=300,
    )  # fmt: skip
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2
    manifest_dir = json.loads((tmp_path / "runs" / "parquet" / "data.json").read_text())["prepared"]
    assert json.loads((Path(manifest_dir) / "manifest.json").read_text())["documents"] == len(paragraphs)
