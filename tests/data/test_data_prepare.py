"""prepare_data: tokenizer + shards in a content-addressed cache, val split, atomic publication."""

import json
import os
import shutil

import numpy as np
import pytest

import phalanx.data.parts as parts_module
import phalanx.data.prepare as prepare_module
from phalanx.data.prepare import PreparedData, prepare_data
from phalanx.data.shards import read_shard
from phalanx.data.tokenizer import load_tokenizer, train_tokenizer
from phalanx.errors import PhalanxError

WORDS = "the king and queen of verona speak softly to a ghost while night falls on elsinore".split()


def make_corpus(dir, docs=3, words=400, seed=0):
    rng = np.random.default_rng(seed)
    dir.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        (dir / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS, words)) + "\n")


def prepare(tmp_path, **overrides):
    args = dict(
        sources=["corpus"],
        base_dir=tmp_path,
        cache_root=tmp_path / "cache",
        vocab_size=300,
        tokenizer=None,
        val_fraction=0.1,
    )
    return prepare_data(**{**args, **overrides})


def test_prepares_shards_manifest_and_a_val_split_of_each_document(tmp_path):
    make_corpus(tmp_path / "corpus")
    data = prepare(tmp_path)
    assert data.dir.parent == tmp_path / "cache" and data == PreparedData.load(data.dir)
    assert data.val_tokens > 0 and data.train_tokens > 0
    train = np.concatenate([read_shard(p) for p in data.train_shards])
    val = np.concatenate([read_shard(p) for p in data.val_shards])
    assert (len(train), len(val)) == (data.train_tokens, data.val_tokens)
    # each of the 3 documents is split: [BOS ... | ... EOS], so the val stream holds 3 tails ending in EOS
    tok = load_tokenizer(data.tokenizer_path)
    assert (train == 0).sum() == 3 and (val == 1).sum() == 3 and (train == 1).sum() == 0
    assert 0.08 < data.val_tokens / (data.train_tokens + data.val_tokens) < 0.12
    train_parts = np.split(train, np.flatnonzero(train == 0)[1:])  # each starts with BOS
    val_parts = np.split(val, np.flatnonzero(val == 1)[:-1] + 1)  # each ends with EOS
    for i, (head, tail) in enumerate(zip(train_parts, val_parts, strict=True)):
        assert tok.decode(np.concatenate([head, tail]).tolist()) == (tmp_path / "corpus" / f"doc{i}.txt").read_text()
    manifest = json.loads((data.dir / "manifest.json").read_text())
    assert manifest["sources"] == ["corpus"] and manifest["documents"] == 3 and "created" in manifest
    assert manifest["vocab_size"] == data.vocab_size <= 300


def test_second_call_reuses_the_cache_without_retokenising(tmp_path, monkeypatch):
    make_corpus(tmp_path / "corpus")
    first = prepare(tmp_path)
    mtimes = {p: p.stat().st_mtime_ns for p in first.dir.iterdir()}

    def fail(*args, **kwargs):
        raise AssertionError("retokenised a cached corpus")

    monkeypatch.setattr(prepare_module, "train_tokenizer", fail)
    monkeypatch.setattr(parts_module, "encode_documents", fail)  # small: tokenised in this process
    second = prepare(tmp_path)
    assert second == first
    assert {p: p.stat().st_mtime_ns for p in second.dir.iterdir()} == mtimes
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.dir.name]  # no temp dirs left


def test_changed_inputs_get_a_new_cache_dir(tmp_path):
    make_corpus(tmp_path / "corpus")
    first = prepare(tmp_path)
    assert prepare(tmp_path, val_fraction=0.2).dir != first.dir
    assert prepare(tmp_path, vocab_size=320).dir != first.dir
    (tmp_path / "corpus" / "doc0.txt").write_text("a different play entirely " * 50)
    assert prepare(tmp_path).dir != first.dir


def test_many_short_documents_still_get_a_val_split(tmp_path):
    rng = np.random.default_rng(1)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS, 3))}) for _ in range(200)]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "short.jsonl").write_text("\n".join(lines) + "\n")
    data = prepare(tmp_path, val_fraction=0.05)
    assert 0.03 < data.val_tokens / (data.train_tokens + data.val_tokens) < 0.07
    val = np.concatenate([read_shard(p) for p in data.val_shards])
    assert val[0] == 0 and val[-1] == 1  # whole documents, not fragments


def test_user_tokenizer_is_copied_and_used(tmp_path):
    make_corpus(tmp_path / "corpus")
    own = train_tokenizer(["some unrelated text for a user tokenizer"] * 5, vocab_size=280)
    own.save(str(tmp_path / "own.json"))
    data = prepare(tmp_path, tokenizer="own.json", vocab_size=512)
    assert data.tokenizer_path.parent == data.dir
    assert load_tokenizer(data.tokenizer_path).get_vocab() == own.get_vocab()
    assert data.vocab_size == own.get_vocab_size()
    with pytest.raises(PhalanxError, match="has 280 token ids but vocab_size is 270"):
        prepare(tmp_path, tokenizer="own.json", vocab_size=270)
    with pytest.raises(PhalanxError, match=r"tokenizer file .*missing\.json not found"):
        prepare(tmp_path, tokenizer="missing.json")


def test_bad_val_fraction_and_empty_corpus(tmp_path):
    make_corpus(tmp_path / "corpus")
    with pytest.raises(PhalanxError, match="val_fraction must be in"):
        prepare(tmp_path, val_fraction=1.0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("\n")
    with pytest.raises(PhalanxError, match="corpus is empty"):
        prepare(tmp_path, sources=["empty"])
    assert list((tmp_path / "cache").iterdir()) == []  # the failed attempt left no temp dir


def test_losing_a_concurrent_preparation_uses_the_winners_result(tmp_path, monkeypatch):
    make_corpus(tmp_path / "corpus")
    real_rename = os.rename

    def another_process_wins(src, dst):
        shutil.copytree(src, dst)  # the winner publishes the same key first
        (dst / "winner").touch()
        real_rename(src, dst)  # raises: dst exists and is not empty

    monkeypatch.setattr(prepare_module.os, "rename", another_process_wins)
    data = prepare(tmp_path)
    assert (data.dir / "winner").exists()
    assert data == PreparedData.load(data.dir)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [data.dir.name]
