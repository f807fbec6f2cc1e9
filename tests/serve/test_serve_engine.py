"""The engine without HTTP: continuous batching that never changes a request's tokens, the context and
queue limits, cancellation, stop strings, and the batched-decode path of the model itself."""

from __future__ import annotations

import threading

import pytest
import torch

from phalanx.models.decoder import KVCache, ModelArgs, Transformer
from phalanx.models.token_pass import Cached, DecodeRows
from phalanx.serve.core.contract import PromptTooLong, QueueFull
from phalanx.serve.core.options import InvalidOptions, SamplingOptions
from phalanx.serve.engines.torch_engine import Engine

# Random weights: every context gives its own argmax, so any bit a neighbour changed would show.
ARGS = ModelArgs(
    dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=192, vocab_size=512, max_seq_len=160, rope_theta=10000.0
)


def engine(model, tokenizer, **kwargs) -> Engine:
    e = Engine(model, tokenizer, **kwargs)
    e.start()
    return e


def ids(tokenizer, text: str) -> list[int]:
    return [0] + tokenizer.encode(text).ids


def mixed_requests(tokenizer) -> list[tuple[list[int], SamplingOptions]]:
    """16 requests of different lengths: greedy ones, greedy with penalties, seeded samples."""
    requests = []
    for i in range(16):
        prompt = ids(tokenizer, "ROMEO: " + "wherefore art thou " * (i % 5) + f"speak {i}")
        if i % 4 == 3:
            options = SamplingOptions(temperature=0.9, top_k=50, top_p=0.95, seed=i, max_tokens=12 + i)
        elif i % 4 == 2:
            options = SamplingOptions(temperature=0, repeat_penalty=1.3, repeat_last_n=16, max_tokens=20 + i)
        else:
            options = SamplingOptions(temperature=0, max_tokens=10 + 2 * i)
        requests.append((prompt, options))
    return requests


def test_tokens_are_the_same_alone_and_in_a_busy_batch(model, tokenizer):
    requests = mixed_requests(tokenizer)
    e = engine(model, tokenizer, slots=6, max_queue=16)  # fewer slots than requests: some join mid-batch
    try:
        alone = []
        for prompt, options in requests:
            stream = e.submit(prompt, options)
            alone.append((stream.text(), stream.finish.completion_tokens, stream.finish.reason))
        together: list = [None] * len(requests)
        streams = [e.submit(prompt, options) for prompt, options in requests]

        def collect(i):
            together[i] = (streams[i].text(), streams[i].finish.completion_tokens, streams[i].finish.reason)

        threads = [threading.Thread(target=collect, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        e.stop()
    assert len({text for text, _, _ in alone}) == len(requests)  # every request says something different
    assert together == alone


def test_batched_decode_matches_the_plain_forward(model):
    """The per-row-position path (Attention.attend_rows) computes what the ordinary forward computes."""
    torch.manual_seed(1)
    lengths = [5, 17, 1, 30]
    seqs = [torch.randint(0, ARGS.vocab_size, (n + 1,)) for n in lengths]
    cache = KVCache(ARGS, len(seqs), 64)
    with torch.no_grad():
        for row, seq in enumerate(seqs):  # prefill each row alone, as the engine does
            view = type(
                "Row",
                (),
                {"max_len": 64, "layer": lambda self, i, r=row: (cache.k[i][r : r + 1], cache.v[i][r : r + 1])},
            )()
            model(seq[None, :-1], Cached(view, 0))
        last = torch.stack([seq[-1] for seq in seqs])[:, None]
        batched = model(last, DecodeRows(cache, torch.tensor(lengths)))[:, 0]
        for row, seq in enumerate(seqs):
            torch.testing.assert_close(batched[row], model(seq[None])[0, -1], rtol=0, atol=1e-5)


def test_prompt_beyond_the_context_is_refused_and_generation_stops_at_it(model, tokenizer):
    e = engine(model, tokenizer, slots=2, context=64)
    try:
        with pytest.raises(PromptTooLong, match="64"):
            e.submit(list(range(64)), SamplingOptions(temperature=0))
        stream = e.submit([0] + list(range(2, 61)), SamplingOptions(temperature=0, max_tokens=100, ignore_eos=True))
        stream.text()
        assert (stream.finish.reason, stream.finish.prompt_tokens, stream.finish.completion_tokens) == ("length", 60, 4)
        stream = e.submit([0, 5], SamplingOptions(temperature=0, max_tokens=0))
        assert stream.text() == "" and stream.finish.reason == "length"
    finally:
        e.stop()


def test_full_queue_is_refused_and_the_queued_requests_still_finish(model, tokenizer):
    e = Engine(model, tokenizer, slots=2, max_queue=3)  # not started: requests only queue
    options = SamplingOptions(temperature=0, max_tokens=4)
    streams = [e.submit([0, 10 + i], options) for i in range(5)]
    with pytest.raises(QueueFull, match="busy"):
        e.submit([0, 99], options)
    e.start()
    try:
        for stream in streams:
            stream.text()
            assert stream.finish.reason in ("length", "stop")
        e.submit([0, 99], options).text()  # room again
    finally:
        e.stop()


def test_cancel_frees_the_slot(model, tokenizer):
    e = engine(model, tokenizer, slots=1, max_queue=1)
    try:
        long = e.submit([0, 7], SamplingOptions(temperature=0, ignore_eos=True))
        first = next(iter(long))
        assert first is not None
        long.cancel()
        list(long)
        assert long.finish.reason == "cancelled" and long.finish.completion_tokens < ARGS.max_seq_len - 2
        after = e.submit([0, 8], SamplingOptions(temperature=0, max_tokens=3))
        after.text()
        assert after.finish.reason in ("length", "stop")
    finally:
        e.stop()


def test_stop_string_ends_generation_and_is_not_returned(model, tokenizer):
    e = engine(model, tokenizer, slots=2)
    try:
        prompt = ids(tokenizer, "JULIET: O Romeo")
        full = e.submit(prompt, SamplingOptions(temperature=0, max_tokens=40, ignore_eos=True)).text()
        stop = full[12:15]
        assert len(stop) == 3
        stream = e.submit(prompt, SamplingOptions(temperature=0, max_tokens=40, stop=(stop,)))
        assert stream.text() == full[: full.index(stop)]
        assert stream.finish.reason == "stop"
    finally:
        e.stop()


def test_seeded_sampling_repeats_and_seeds_differ(model, tokenizer):
    e = engine(model, tokenizer, slots=3)
    try:

        def sample(seed):
            return e.submit([0, 42], SamplingOptions(temperature=1.0, seed=seed, max_tokens=20, ignore_eos=True)).text()

        assert sample(1) == sample(1)
        assert sample(1) != sample(2)
    finally:
        e.stop()


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"top_k": -1},
        {"repeat_penalty": 0},
        {"repeat_last_n": -2},
        {"max_tokens": -1},
        {"stop": ("",)},
        {"presence_penalty": 3},
    ],
)
def test_options_out_of_range_are_refused(bad):
    with pytest.raises(InvalidOptions):
        SamplingOptions(**bad)


def test_a_rows_logits_never_depend_on_its_neighbours_or_its_row():
    """What the engine's promise rests on, bit for bit: one sequence decoded in row 0 of an idle batch
    and in row 11 of a batch of other sequences at other lengths gives identical logits."""
    args = ModelArgs(
        dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=512, vocab_size=512, max_seq_len=256, rope_theta=10000.0
    )
    torch.manual_seed(0)
    net = Transformer(args).eval()
    seq = torch.randint(0, args.vocab_size, (40,))

    def logits_in(row: int, busy: bool) -> torch.Tensor:
        slots = 16
        cache = KVCache(args, slots, args.max_seq_len)
        gen = torch.Generator().manual_seed(row)
        tokens, positions = torch.zeros(slots, 1, dtype=torch.long), torch.zeros(slots, dtype=torch.long)
        if busy:  # neighbours: other cached keys and values, other tokens, other positions
            for k, v in zip(cache.k, cache.v):
                k.normal_(generator=gen)
                v.normal_(generator=gen)
            tokens = torch.randint(0, args.vocab_size, (slots, 1), generator=gen)
            positions = torch.randint(0, args.max_seq_len, (slots,), generator=gen)
        view = type(
            "Row",
            (),
            {
                "max_len": args.max_seq_len,
                "layer": lambda self, i: (cache.k[i][row : row + 1], cache.v[i][row : row + 1]),
            },
        )()
        with torch.no_grad():
            net(seq[None, :-1], Cached(view, 0))
            tokens[row, 0], positions[row] = seq[-1], len(seq) - 1
            return net(tokens, DecodeRows(cache, positions))[row, 0]

    alone = logits_in(0, busy=False)
    for row in (0, 5, 11, 15):
        assert torch.equal(logits_in(row, busy=True), alone), f"row {row} differs"
