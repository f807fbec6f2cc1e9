"""Decode steps sized to the running requests (serve/engines/torch_engine.py: bucketed widths and spans, rows kept packed) never
change a request's output: one request on a 16-slot server gets exactly what a 1-slot server gives it, and
requests joining and leaving mid-decode (widths changing, rows moved down) change no other request's
tokens or log-probabilities. Log-probabilities are compared exactly, so a single bit a neighbour changed
in a row's logits would show, not only a changed argmax."""

from __future__ import annotations

import threading

import pytest
import torch

from phalanx.models.decoder import ModelArgs
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.engines.row_invariant import RowInvariantLinear, rows_agree
from phalanx.serve.engines.torch_engine import Engine, step_span, step_width

ARGS = ModelArgs(
    dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=1152, vocab_size=512, max_seq_len=160, rope_theta=10000.0
)  # ffn 1152: w2's reduction is cut in two chunks (row_invariant.py)


def prompt(tokenizer, i: int) -> list[int]:
    return [0] + tokenizer.encode("JULIET: " + "o Romeo " * (i % 4) + f"line {i}").ids


def output(stream) -> tuple:
    text = stream.text()
    return text, stream.finish.completion_tokens, stream.finish.reason, stream.logprobs


def alone(model, tokenizer, requests) -> list[tuple]:
    e = Engine(model, tokenizer, slots=1, max_queue=len(requests))
    e.start()
    try:
        return [output(e.submit(ids, options, top_logprobs=2)) for ids, options in requests]
    finally:
        e.stop()


def test_widths_and_spans_are_few_and_cover_the_rows():
    assert [step_width(n, 16) for n in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8
    assert [step_width(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    spans = {step_span(n, 2048) for n in range(1, 2049)}
    assert len(spans) <= 30 and max(spans) == 2048
    for n in range(1, 2049):
        assert n <= step_span(n, 2048) <= max(32, n * 1.25)
    assert step_span(300, 256) == 256  # never beyond the cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_invariant_linear_gives_each_row_the_same_bits_at_any_batch_size(dtype):
    from phalanx.parallel.device import cpu_has_bf16_units

    if dtype == torch.bfloat16 and not cpu_has_bf16_units():  # oneDNN's reference bf16 path: the engine checks
        pytest.skip("no bf16 units on this CPU: its bf16 rows are not invariant, and the engine checks that at start")
    torch.manual_seed(0)
    for k, n in [(96, 192), (1152, 96), (2100, 64)]:  # one chunk, two, three
        plain = torch.nn.Linear(k, n, bias=False).to(dtype)
        linear = RowInvariantLinear(plain)
        x = torch.randn(16, 1, k).to(dtype)  # (rows, 1, features), as a decode step has them
        with torch.no_grad():
            one_by_one = torch.cat([linear(x[r : r + 1]) for r in range(16)])
            for m in range(2, 17):
                assert torch.equal(linear(x[:m]), one_by_one[:m]), (k, n, m)
            atol = 1e-4 if dtype == torch.float32 else 0.1
            torch.testing.assert_close(linear(x), plain(x), rtol=0, atol=atol)


def test_a_cpu_whose_matmul_is_not_row_invariant_keeps_full_width_steps():
    class PlainMatmul(RowInvariantLinear):  # torch's default CPU matmul (MKL): rows differ by batch width
        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight, self.bias)

    linear = torch.nn.Linear(384, 1024, bias=False)
    assert rows_agree(RowInvariantLinear(linear))
    assert not rows_agree(PlainMatmul(linear))  # what make_rows_invariant checks before it swaps for good


def test_one_request_on_sixteen_slots_is_what_one_slot_gives_and_runs_one_row(model, tokenizer):
    requests = [(prompt(tokenizer, i), SamplingOptions(temperature=0, max_tokens=40 + 10 * i)) for i in range(3)]
    requests.append((prompt(tokenizer, 7), SamplingOptions(temperature=0.8, top_k=40, seed=3, max_tokens=50)))
    expected = alone(model, tokenizer, requests)
    e = Engine(model, tokenizer, slots=16, max_queue=4)
    assert e.sized_steps
    shapes = []
    hook = model.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    e.start()
    try:
        got = [output(e.submit(ids, options, top_logprobs=2)) for ids, options in requests]
    finally:
        e.stop()
        hook.remove()
    assert got == expected
    decode_widths = {width for width, length in shapes if length == 1}
    assert decode_widths == {1}  # not 16: the idle slots cost nothing


def test_joining_and_leaving_mid_decode_changes_no_other_requests_output(model, tokenizer):
    """A long request decodes while others join one by one (width 1 -> 2 -> 4 -> 8) and leave at other
    times, the early leavers from low rows (so later rows are moved down into theirs)."""
    lengths = [110, 6, 60, 12, 80, 9, 30, 45, 20]
    requests = []
    for i, n in enumerate(lengths):
        if i % 3 == 2:
            options = SamplingOptions(temperature=0.9, top_p=0.9, seed=i, max_tokens=n)
        elif i % 3 == 1:
            options = SamplingOptions(temperature=0, repeat_penalty=1.2, max_tokens=n)
        else:
            options = SamplingOptions(temperature=0, max_tokens=n)
        requests.append((prompt(tokenizer, i), options))
    expected = alone(model, tokenizer, requests)
    assert len({text for text, *_ in expected}) == len(requests)

    e = Engine(model, tokenizer, slots=16, max_queue=16)
    e.start()
    got: list = [None] * len(requests)
    started = [threading.Event() for _ in requests]

    def collect(i, stream):
        pieces = []
        for piece in stream:
            pieces.append(piece)
            started[i].set()
        started[i].set()
        got[i] = ("".join(pieces), stream.finish.completion_tokens, stream.finish.reason, stream.logprobs)

    threads = []
    try:
        for i, (ids, options) in enumerate(requests):
            stream = e.submit(ids, options, top_logprobs=2)
            threads.append(threading.Thread(target=collect, args=(i, stream)))
            threads[-1].start()
            started[i].wait(60)  # join the next one only once this one decodes: joins land mid-decode
        for t in threads:
            t.join(120)
    finally:
        e.stop()
    for i in range(len(requests)):
        assert got[i] == expected[i], f"request {i} changed in the busy batch"
