"""Streaming text: whole characters only, stop strings never leaked; and the per-request sampler."""

from __future__ import annotations

import pytest
import torch

from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.core.sampler import RequestSampler
from phalanx.serve.core.text_stream import IncrementalText, StopMatcher

MULTIBYTE = "ROMEO: café, naïve — 日本語の詩 🎭🗡️ and Ω≈ç√ at last."


@pytest.fixture(scope="module")
def tokenizer(corpus):
    from phalanx.data.tokenizer import train_tokenizer

    return train_tokenizer([corpus.read_text()], 384)


def test_streamed_pieces_never_split_a_character(tokenizer):
    ids = tokenizer.encode(MULTIBYTE).ids
    # The corpus is English: most of these characters are several byte tokens each.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    text = IncrementalText(tokenizer)
    pieces = [text.push(i) for i in ids] + [text.flush()]
    assert "" in pieces  # some tokens held back until their character was complete
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == MULTIBYTE == tokenizer.decode(ids)


def test_invalid_bytes_come_out_eventually(tokenizer):
    lone_byte = tokenizer.encode("é").ids[:1]  # the first byte of a two-byte character, alone
    text = IncrementalText(tokenizer)
    out = "".join(text.push(i) for i in lone_byte + tokenizer.encode(" ok").ids) + text.flush()
    assert out == "\ufffd ok"


def test_stop_string_across_pieces_is_cut_and_never_leaked():
    stops = StopMatcher(["\n\nUSER:"])
    out = [stops.push(p) for p in ["Hel", "lo\n", "\nUS", "ER: more"]]
    assert out == ["Hel", "lo", "", ""] and stops.stopped
    assert stops.flush() == ""


def test_a_partial_stop_is_released_when_it_does_not_complete():
    stops = StopMatcher(["\n\nUSER:", "END"])
    assert stops.push("a\n\nUS") == "a"
    assert stops.push("ED E") == "\n\nUSED "
    assert stops.flush() == "E" and not stops.stopped


def test_earliest_stop_wins():
    stops = StopMatcher(["b", "abc"])
    assert stops.push("xxabc") == "xx" and stops.stopped  # "abc" starts before "b"


def logits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def sampler(prompt=(), **options) -> RequestSampler:
    return RequestSampler(SamplingOptions(**options), list(prompt), 1024, torch.device("cpu"))


def test_top_k_one_min_p_one_and_tiny_top_p_are_all_greedy():
    row = logits([0.1, 2.0, 1.9, -1.0, 1.95])
    for options in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 0.0}):
        s = sampler(temperature=5.0, seed=0, **options)
        assert {s.pick(row) for _ in range(30)} == {1}


def test_top_k_limits_the_choice_and_seeds_repeat():
    row = logits([3.0, 2.9, 2.8, -5.0, 2.7, 2.95])
    draws = [sampler(temperature=2.0, top_k=3, seed=s).pick(row) for s in range(60)]
    assert set(draws) == {0, 1, 5}
    again = [sampler(temperature=2.0, top_k=3, seed=s).pick(row) for s in range(60)]
    assert draws == again


def test_repeat_penalty_steers_greedy_away_from_recent_tokens():
    row = logits([0.0, 2.0, 1.9, 0.5])
    assert sampler(temperature=0).pick(row) == 1
    s = sampler(prompt=[1], temperature=0, repeat_penalty=1.2, repeat_last_n=4)
    assert s.pick(row) == 2  # 2.0 / 1.2 < 1.9
    for token in (3, 3, 3, 3):  # token 1 leaves the window of the last 4
        s.accept(token)
    assert s.pick(row) == 1


def test_frequency_and_presence_penalties_count_occurrences():
    row = logits([0.0, 2.0, 1.5])
    assert sampler(prompt=[1], temperature=0, presence_penalty=0.4).pick(row) == 1
    assert sampler(prompt=[1, 1], temperature=0, presence_penalty=0.4, frequency_penalty=0.1).pick(row) == 2
