"""The tokenizer's training text is bounded (data.tokenizer_sample_bytes): a corpus under the bound is read
whole, as before the bound existed; a larger one gives each source its share and reads no further."""

from __future__ import annotations

import json
from pathlib import Path

from phalanx.data.corpus import iter_documents, resolve_sources
from phalanx.data.prepare import prepare_data
from phalanx.data.tokenizer_sample import DEFAULT_SAMPLE_BYTES, capped, sample_documents
from tests.data.prepare_helpers import make_corpus


def test_a_corpus_under_the_bound_is_read_whole_in_order(tmp_path):
    sources = resolve_sources([str(make_corpus(tmp_path / "corpus"))], tmp_path)
    assert list(sample_documents(sources, "text", DEFAULT_SAMPLE_BYTES)) == list(iter_documents(sources))


def test_the_bound_only_changes_the_tokenizer_of_a_corpus_above_it(tmp_path):
    make_corpus(tmp_path / "corpus")
    args = (["corpus"], tmp_path, tmp_path / "cache", 400, None, 0.1)
    default = prepare_data(*args)
    bigger = prepare_data(*args, tokenizer_sample_bytes=2 * DEFAULT_SAMPLE_BYTES)
    tiny = prepare_data(*args, tokenizer_sample_bytes=2000)
    assert len({default.dir, bigger.dir, tiny.dir}) == 3  # a bound other than the default is in the key
    assert default.tokenizer_path.read_bytes() == bigger.tokenizer_path.read_bytes()  # read whole either way
    assert tiny.tokenizer_path.read_bytes() != default.tokenizer_path.read_bytes()


def test_a_corpus_above_the_bound_gives_each_source_its_share_and_reads_no_further(tmp_path):
    record = lambda name, i: json.dumps({"text": f"{name} {i} " + "word " * 20}) + "\n"  # noqa: E731
    (tmp_path / "a.jsonl").write_text("".join(record("a", i) for i in range(300)))
    # b: as big as a, but past its first fifth lines that do not parse: reading them would raise
    good = "".join(record("b", i) for i in range(60))
    broken = "{broken\n" * ((Path(tmp_path / "a.jsonl").stat().st_size - len(good)) // 8)
    (tmp_path / "b.jsonl").write_text(good + broken)
    sources = resolve_sources([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], tmp_path)
    sizes = [s.path.stat().st_size for s in sources]
    limit = sum(sizes) // 10  # a tenth of each file: about 30 of its documents
    docs = list(sample_documents(sources, "text", limit))
    assert sum(len(d.encode()) for d in docs) <= limit
    from_b = [d for d in docs if d.startswith("b ")]
    assert 25 <= len(from_b) <= 40 and 25 <= len(docs) - len(from_b) <= 40


def test_a_document_longer_than_the_bound_is_cut_at_a_character():
    assert list(capped(["ab日本語", "more"], 5)) == ["ab日"]  # 日 is 3 bytes: "ab日" is 5
    assert list(capped(["ab日本語", "more"], 4)) == ["ab"]
    assert list(capped(["abc", "def", "ghi"], 6)) == ["abc", "def"]
