"""Chunked prefill (serve/engines/torch_engine.py, prefill.py): a prompt longer than the engine's prefill_chunk is prefilled a
chunk per step boundary, the running requests decoding between its chunks, and its first token comes after
its last chunk. Its chunks are cut from its length alone, so it gets the same greedy tokens and the same
log-probabilities (compared exactly) alone as beside requests that decode, join and leave meanwhile; and
so do they. The same holds where the engine prefills one prompt at a time and decodes at full shape (the
fallback of a GPU, bf16 on this CPU, int8 layers). Chunk sizes here are small so a tiny model has many."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch

from phalanx.models.decoder import KVCache, ModelArgs, Transformer
from phalanx.models.token_pass import Cached
from phalanx.serve.core.contract import QueueFull
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.core.structured_output import schema_grammar
from phalanx.serve.engines.prefill import chunk_plan, prefill_chunk
from phalanx.serve.engines.torch_engine import Engine

ARGS = ModelArgs(
    dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=1152, vocab_size=512, max_seq_len=320, rope_theta=10000.0
)
CHUNK = 32
LONG = torch.randint(3, ARGS.vocab_size, (230,), generator=torch.Generator().manual_seed(1)).tolist()  # 8 chunks


@pytest.fixture(scope="module")
def bf16_model():
    torch.manual_seed(0)
    return Transformer(ARGS).eval().to(torch.bfloat16)


@pytest.fixture(scope="module")
def fp16_model():
    """float16 on this CPU: oneDNN's row-invariant layers do not take it, so the engine falls back by itself
    (torch's own layers, one prompt at a time, every step at full shape), as on a GPU."""
    torch.manual_seed(0)
    return Transformer(ARGS).eval().to(torch.float16)


class TokenTimes:
    """The engine's own observer hooks: when each token was taken (on the engine thread)."""

    def __init__(self):
        self.times: list[float] = []

    def prompt_prefilled(self, tokens: int) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        pass

    def tokens_generated(self, count: int) -> None:
        self.times.append(time.perf_counter())


def engine(model, tokenizer, slots: int, fallback: bool = False, chunk: int | None = CHUNK, **kwargs) -> Engine:
    e = Engine(model, tokenizer, slots=slots, max_queue=8, **kwargs)
    e.prefill_chunk = chunk
    if fallback:  # what a GPU or int8 layers get: one prompt at a time, every step at full shape
        e.batched_prefill, e.sized_steps, e.prefill_budget = False, False, float("inf")
    return e


def output(stream) -> tuple:
    text = stream.text()
    return text, stream.finish.completion_tokens, stream.finish.reason, stream.logprobs


def alone(model, tokenizer, ids, options, fallback=False, chunk=CHUNK, grammar=None, top_logprobs=2, slots=1) -> tuple:
    e = engine(model, tokenizer, slots, fallback, chunk)
    e.start()
    try:
        constraint = None if grammar is None else e.vocabulary.constraint(grammar)
        return output(e.submit(ids, options, top_logprobs=top_logprobs, constraint=constraint))
    finally:
        e.stop()


def short(i: int) -> list[int]:
    return [0, *range(5 + i, 5 + i + 3 + 4 * i)]


def test_a_chunk_plan_covers_the_prompt_and_depends_on_its_length_alone():
    assert chunk_plan(230, 32) == [(s, min(s + 32, 230)) for s in range(0, 230, 32)]
    assert chunk_plan(64, 32) == [(0, 32), (32, 64)] and chunk_plan(5, 32) == [(0, 5)]


def test_chunks_attend_over_the_cached_positions_before_them(model):
    """Chunk by chunk gives the one-pass prefill's logits and keys (to rounding: other product shapes)."""
    one, chunked = KVCache(ARGS, 1, ARGS.max_seq_len), KVCache(ARGS, 1, ARGS.max_seq_len)
    with torch.no_grad():
        expected = model(torch.tensor([LONG]), Cached(one))[0, -1]
        for start, end in chunk_plan(len(LONG), CHUNK):
            got = prefill_chunk(model, LONG[start:end], chunked, start)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    for a, b in zip(chunked.k + chunked.v, one.k + one.v):
        assert torch.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize(
    "fallback,dtype",
    [(False, "f32"), (True, "f32"), (True, "bf16"), (False, "fp16")],
    ids=["batched", "one-at-a-time-full-shape", "one-at-a-time-full-shape-bf16", "torch-layers-fp16"],
)
def test_a_long_prompt_gets_its_tokens_alone_while_others_decode_between_its_chunks(
    request, tokenizer, fallback, dtype
):
    model = request.getfixturevalue({"f32": "model", "bf16": "bf16_model", "fp16": "fp16_model"}[dtype])
    # Torch's own layers give a row other bits at another product height or batch index, so "alone" there
    # is alone on a server of the same width (steps at full shape), at the same cache row.
    slots = 4 if dtype == "fp16" else 1
    long_options = SamplingOptions(temperature=0, max_tokens=12, ignore_eos=True)
    runner_options = SamplingOptions(temperature=0, max_tokens=250, ignore_eos=True)
    later_options = SamplingOptions(temperature=0, repeat_penalty=1.3, max_tokens=6, ignore_eos=True)
    expected_long = alone(model, tokenizer, LONG, long_options, fallback, slots=slots)
    expected_runner = alone(model, tokenizer, short(0), runner_options, fallback, slots=slots)
    expected_later = [alone(model, tokenizer, short(i), later_options, fallback, slots=slots) for i in (1, 2)]

    times = TokenTimes()
    e = engine(model, tokenizer, 4, fallback, observer=times)
    assert (e.batched_prefill, e.sized_steps) == ((False, False) if fallback or dtype == "fp16" else (True, True))
    e.start()
    try:
        runner = e.submit(short(0), runner_options, top_logprobs=2)
        pieces = iter(runner)
        first = [next(pieces)]  # it is decoding before the long prompt arrives
        long = e.submit(LONG, long_options, top_logprobs=2)
        later = [e.submit(short(i), later_options, top_logprobs=2) for i in (1, 2)]  # behind the long one
        got_long, got_later = output(long), [output(s) for s in later]
        got_runner = (
            "".join(first + list(pieces)),
            runner.finish.completion_tokens,
            runner.finish.reason,
            runner.logprobs,
        )
    finally:
        e.stop()
    assert got_long == expected_long
    assert got_runner == expected_runner
    assert got_later == expected_later
    # Between its first chunk and its first token, one decode step after each chunk but the last: the
    # runner's tokens (the two short ones joined behind it, so their tokens count as well, from the
    # boundary of the first chunk on); in one pass there would be none.
    f = long.finish
    during = [t for t in times.times if f.prefill_started_at < t < f.first_token_at]
    chunks = len(chunk_plan(len(LONG), CHUNK))
    assert len(during) >= chunks - 1, (len(during), chunks)
    # The short requests behind it did not wait for its whole prefill.
    assert all(s.finish.first_token_at < f.first_token_at for s in later)


def tokens_during_long_prefill(model, tokenizer, slots: int, runner_tokens: int, **chunk) -> list[float]:
    """One runner decoding, then LONG arrives: when the runner's tokens came out while LONG prefilled."""
    times = TokenTimes()
    e = engine(model, tokenizer, slots, observer=times, **chunk)
    e.start()
    try:
        runner = e.submit(short(0), SamplingOptions(temperature=0, max_tokens=runner_tokens, ignore_eos=True))
        pieces = iter(runner)
        next(pieces)
        long = e.submit(LONG, SamplingOptions(temperature=0, max_tokens=2, ignore_eos=True))
        long.text(), list(pieces)
    finally:
        e.stop()
    f = long.finish
    return [t for t in times.times if f.prefill_started_at < t < f.first_token_at]


def test_without_chunks_a_long_prompt_stalls_the_running_streams(model, tokenizer):
    """The counter-case: prefill_chunk None, the long prompt in one pass, no token comes out meanwhile."""
    assert not tokens_during_long_prefill(model, tokenizer, 4, 30, chunk=None)


def test_exactly_one_decode_step_between_chunks(model, tokenizer):
    """With one runner and nothing else joining, the runner takes one token per boundary between chunks."""
    during = tokens_during_long_prefill(model, tokenizer, 2, 250)
    assert len(during) == len(chunk_plan(len(LONG), CHUNK)) - 1


def test_cancelling_a_long_prompt_mid_prefill_frees_its_slot_and_the_next_is_unchanged(model, tokenizer):
    options = SamplingOptions(temperature=0, max_tokens=8, ignore_eos=True)
    other = LONG[::-1]
    expected = alone(model, tokenizer, other, options, chunk=1)
    e = engine(model, tokenizer, 2, chunk=1, observer=TokenTimes())  # a chunk per token: a long prefill to cut
    e.start()
    try:
        with long_cancelled_mid_prefill(e, options) as doomed:
            assert doomed.text() == "" and doomed.finish.reason == "cancelled"
            assert doomed.finish.completion_tokens == 0 and doomed.finish.first_token_at is None
            assert e.active == 1  # its slot is free again
        got = output(e.submit(other, options, top_logprobs=2))  # the chunk cache starts over for it
    finally:
        e.stop()
    assert got == expected


@contextlib.contextmanager
def long_cancelled_mid_prefill(e: Engine, options: SamplingOptions):
    """LONG, cancelled a few chunk boundaries into its prefill beside a runner that keeps decoding; on
    leaving, the runner is cancelled and its stream drained (an undrained stream blocks the engine)."""
    times = e.observer
    runner = e.submit(short(0), SamplingOptions(temperature=0, max_tokens=300, ignore_eos=True))
    pieces = iter(runner)
    next(pieces)
    doomed = e.submit(LONG, options)
    seen = len(times.times)
    while len(times.times) < seen + 5:  # a few boundaries in: some of its chunks are done
        time.sleep(0.002)
    doomed.cancel()
    try:
        yield doomed
    finally:
        runner.cancel()
        list(pieces)


def test_a_prompt_holds_its_slot_while_it_is_prefilled_chunk_by_chunk(model, tokenizer):
    times = TokenTimes()
    e = Engine(model, tokenizer, slots=1, max_queue=0, observer=times)
    e.prefill_chunk = 1  # 230 boundaries of prefill
    e.start()
    try:
        long = e.submit(LONG, SamplingOptions(temperature=0, max_tokens=4))
        while e.waiting:  # until it has joined
            time.sleep(0.001)
        with pytest.raises(QueueFull):
            e.submit(short(1), SamplingOptions(temperature=0, max_tokens=4))
        assert not times.times  # it was still prefilling: no token yet
        long.text()
    finally:
        e.stop()
    assert long.finish.completion_tokens == 4


def test_a_chunked_prompt_that_fills_the_context_under_a_grammar_with_logprobs(model, tokenizer):
    """context - 1 prompt tokens (nine chunks of 32 and one of 31): room for one token, which the grammar
    shapes from the first; and a grammar's whole reply after a long prompt, beside a runner as alone."""
    grammar = schema_grammar({"enum": ["yes", "no"]})
    fill = (LONG * 2)[: ARGS.max_seq_len - 1]
    options = SamplingOptions(temperature=0, max_tokens=20)
    expected = alone(model, tokenizer, LONG, options, grammar=grammar, top_logprobs=3)
    e = engine(model, tokenizer, 2)
    e.start()
    try:
        full = e.submit(
            fill, SamplingOptions(temperature=0), top_logprobs=3, constraint=e.vocabulary.constraint(grammar)
        )
        full_text = full.text()
        runner = e.submit(short(0), SamplingOptions(temperature=0, max_tokens=100, ignore_eos=True))
        pieces = iter(runner)
        next(pieces)
        shaped = output(e.submit(LONG, options, top_logprobs=3, constraint=e.vocabulary.constraint(grammar)))
        runner.cancel()
        list(pieces)
    finally:
        e.stop()
    assert full.finish.reason == "length" and full.finish.completion_tokens == 1
    assert full_text and ('"yes"'.startswith(full_text) or '"no"'.startswith(full_text))  # the grammar's first
    assert len(full.logprobs) == 1 and len(full.logprobs[0]["top_logprobs"]) == 3
    assert shaped[2] == "stop" and json.loads(shaped[0]) in ("yes", "no")
    assert shaped == expected


# A chat's next turn: the last prompt, its reply and a new message (270 tokens: 8 whole chunks and 14).
NEXT_TURN = LONG + torch.randint(3, ARGS.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()


@pytest.mark.parametrize("fallback,dtype", [(False, "f32"), (True, "bf16")], ids=["batched-f32", "one-at-a-time-bf16"])
def test_a_long_prompt_skips_the_whole_chunks_it_shares_with_the_last_and_gets_its_tokens_alone(
    request, tokenizer, fallback, dtype
):
    """The chunk cache still holds the last long prompt's keys and values: a prompt beginning with the same
    whole chunks starts after them, and its tokens and log-probabilities are exactly those of a fresh
    server's (the skipped chunks' passes would have been the very same)."""
    model = request.getfixturevalue({"f32": "model", "bf16": "bf16_model"}[dtype])
    options = SamplingOptions(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [alone(model, tokenizer, ids, options, fallback) for ids in (LONG, NEXT_TURN, LONG)]
    e = engine(model, tokenizer, 2, fallback)
    e.start()
    try:
        got = [output(e.submit(LONG, options, top_logprobs=2))]
        assert e.reused_prompt_tokens == 0
        got.append(output(e.submit(NEXT_TURN, options, top_logprobs=2)))
        assert e.reused_prompt_tokens == 224  # 7 whole chunks of LONG's 230 tokens
        got.append(output(e.submit(LONG, options, top_logprobs=2)))  # the same prompt: all but its last chunk
        assert e.reused_prompt_tokens == 224 + 224
    finally:
        e.stop()
    assert got == expected


def test_a_scored_prompt_and_a_prompt_after_a_cancelled_one_reuse_only_what_is_there(model, tokenizer):
    """A prompt asking for its own log-probabilities needs every chunk's hidden rows, so it skips none; a
    long prompt cancelled mid-prefill leaves only its finished chunks to share."""
    options = SamplingOptions(temperature=0, max_tokens=6, ignore_eos=True)
    e = engine(model, tokenizer, 2)
    e.start()
    try:
        output(e.submit(LONG, options))
        scored = e.submit(NEXT_TURN, options, prompt_logprobs=1)
        scored.text()
        assert e.reused_prompt_tokens == 0 and len(scored.prompt_logprobs) == len(NEXT_TURN) - 1
    finally:
        e.stop()
    expected = alone(model, tokenizer, NEXT_TURN, options, chunk=1)
    e = engine(model, tokenizer, 2, chunk=1, observer=TokenTimes())  # a chunk per token
    e.start()
    try:
        with long_cancelled_mid_prefill(e, options) as doomed:
            doomed.text()
        got = output(e.submit(NEXT_TURN, options, top_logprobs=2))
    finally:
        e.stop()
    assert 5 <= e.reused_prompt_tokens < len(LONG)
    assert got == expected
