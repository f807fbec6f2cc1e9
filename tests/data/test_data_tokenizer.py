"""Byte-level BPE: training, exact round trips, special tokens, loading user tokenizers."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from phalanx.data.tokenizer import (
    BOS,
    EOS,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    encode_documents,
    load_tokenizer,
    special_ids,
    train_tokenizer,
)
from phalanx.errors import PhalanxError

CORPUS = [
    "But soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n",
    "Grüße aus München! Ça va? Ελληνικά και 日本語のテキスト。\n",
    "    indented code:\n\tif x:\n\t\treturn y  # trailing spaces   \n",
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=400)


def test_special_tokens_have_ids_zero_and_one(tokenizer):
    assert SPECIAL_TOKENS == ["<|begin_of_text|>", "<|end_of_text|>"]
    assert special_ids(tokenizer) == (0, 1)
    assert 258 < tokenizer.get_vocab_size() <= 400  # learnt some merges beyond bytes + specials


@pytest.mark.parametrize(
    "text",
    [
        "It is the east, and Juliet is the sun.",
        "  leading spaces, double  spaces and a trailing newline\n",
        "unseen scripts: 한국어, עברית, emoji 🎭🗡️, combining e\u0301",
        "\x00\x01 control bytes \r\n",
    ],
)
def test_decode_of_encode_is_the_identity(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text


def test_vocab_below_minimum_is_an_error_stating_it():
    assert MIN_VOCAB_SIZE == 259
    with pytest.raises(PhalanxError, match="minimum is 259"):
        train_tokenizer(CORPUS, vocab_size=258)
    train_tokenizer(CORPUS, vocab_size=259)


def test_encode_documents_frames_each_document_in_order(tokenizer):
    docs = ["one", "two two", "three", "four", "five"]
    arrays = list(encode_documents(tokenizer, docs, chunk_size=2))  # several chunks
    assert len(arrays) == len(docs)
    for doc, ids in zip(docs, arrays):
        assert ids[0] == 0 and ids[-1] == 1
        assert tokenizer.decode(ids[1:-1].tolist()) == doc
        assert tokenizer.decode(ids.tolist(), skip_special_tokens=False) == BOS + doc + EOS


def test_load_round_trips_a_saved_tokenizer(tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    loaded = load_tokenizer(path)
    assert loaded.encode(CORPUS[1]).ids == tokenizer.encode(CORPUS[1]).ids


def test_user_tokenizer_without_special_tokens_is_rejected(tmp_path):
    plain = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    path = tmp_path / "plain.json"
    plain.save(str(path))
    message = r"plain\.json lacks the special token\(s\) <\|begin_of_text\|>, <\|end_of_text\|>"
    with pytest.raises(PhalanxError, match=message):
        load_tokenizer(path)


def test_missing_or_unparsable_tokenizer_file(tmp_path):
    with pytest.raises(PhalanxError, match="not found"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PhalanxError, match=r"bad\.json is not a valid tokenizer\.json") as e:
        load_tokenizer(tmp_path / "bad.json")
    assert "\n" not in str(e.value)
