"""The one-row kernel (serve/engines/one_row.py): a lone row's linear products read the packed weight as one
stream and give exactly the bits oneDNN gives that row among others, so the engine may use it for one-stream
decoding without changing any request's tokens. Measured equal on AMD EPYC (Zen 4, AVX-512 with bf16, no
AMX); elsewhere the engine checks at start and keeps oneDNN where the bits differ, which these tests hold
it to as well."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.models.decoder import ModelArgs
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.engines.one_row import one_row_available, one_row_linear, pack_panels
from phalanx.serve.engines.row_invariant import RowInvariantLinear, make_rows_invariant, one_row_agrees
from phalanx.serve.engines.torch_engine import Engine

ARGS = ModelArgs(
    dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=1152, vocab_size=512, max_seq_len=160, rope_theta=10000.0
)  # ffn 1152: w2's reduction is cut in two chunks (row_invariant.py), each its own panels
DTYPES = [torch.float32, torch.bfloat16]
# Where oneDNN's sums were measured to be the kernel's; on other CPUs only consistency is required.
MEASURED_CPU = "AuthenticAMD" in Path("/proc/cpuinfo").read_text() and not torch.cpu._is_amx_tile_supported()


def kernel_or_skip(dtype: torch.dtype) -> None:
    if not one_row_available(dtype):
        pytest.skip(f"no one-row kernel for {dtype} here (no AVX-512, avx512_bf16 or compiler)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_computes_the_product_for_any_shape(dtype):
    """Odd inputs (a zero pads the last bf16 pair), outputs not a multiple of the 64-output panel, long rows."""
    kernel_or_skip(dtype)
    generator = torch.Generator().manual_seed(0)
    for k, n in [(96, 100), (501, 64), (768, 2304), (1000, 130), (2048, 5)]:
        weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype)
        x = torch.randn(1, k, generator=generator).to(dtype)
        got = one_row_linear(x, pack_panels(weight), n)
        assert got.shape == (1, n) and got.dtype == dtype
        exact = x.double() @ weight.double().T
        atol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=atol)


def test_the_kernel_refuses_panels_of_another_shape():
    kernel_or_skip(torch.float32)
    panels = pack_panels(torch.randn(64, 96))
    with pytest.raises(RuntimeError, match="panels of another shape"):
        one_row_linear(torch.randn(1, 128), panels, 64)
    with pytest.raises(RuntimeError, match="one contiguous row"):
        one_row_linear(torch.randn(2, 96), panels, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_lone_row_gets_the_bits_onednn_gives_it_among_sixteen(dtype):
    kernel_or_skip(dtype)
    torch.manual_seed(0)
    for k, n in [(96, 192), (768, 2304), (1152, 96), (2100, 64)]:  # one chunk, one, two, three
        linear = RowInvariantLinear(torch.nn.Linear(k, n, bias=False).to(dtype))
        x = torch.randn(16, 1, k).to(dtype)  # (rows, 1, features), as a decode step has them
        with torch.no_grad():
            among_sixteen = linear(x)  # oneDNN
            linear.pack_one_row()
            alone = torch.cat([linear(x[r : r + 1]) for r in range(16)])  # the kernel
        if MEASURED_CPU:
            assert torch.equal(alone, among_sixteen), (k, n)
            assert one_row_agrees(linear)
        else:  # another CPU: what the engine's check decides must be what the bits say
            assert one_row_agrees(linear) == torch.equal(alone, among_sixteen)


def test_the_check_refuses_a_kernel_that_sums_in_other_blocks():
    """The kernel summing in blocks of 256 inputs, where oneDNN sums 512: the engine's check must see it."""
    kernel_or_skip(torch.float32)
    torch.manual_seed(0)
    linear = RowInvariantLinear(torch.nn.Linear(768, 256, bias=False))
    linear.pack_one_row(block=256)
    assert not one_row_agrees(linear)
    if MEASURED_CPU:
        linear.pack_one_row()
        assert one_row_agrees(linear)


def prompt(tokenizer, i: int) -> list[int]:
    return [0] + tokenizer.encode("ROMEO: " + "but soft " * (i % 3) + f"line {i}").ids


def one_by_one(model, tokenizer) -> list[tuple]:
    e = Engine(model, tokenizer, slots=4, max_queue=4)
    kernel_layers = sum(1 for m in model.modules() if isinstance(m, RowInvariantLinear) and m._panels is not None)
    e.start()
    try:
        out = []
        for i in range(3):
            options = SamplingOptions(temperature=0, max_tokens=30 + 10 * i)
            stream = e.submit(prompt(tokenizer, i), options, top_logprobs=2)
            out.append((stream.text(), stream.finish.completion_tokens, stream.logprobs))
        return out, kernel_layers
    finally:
        e.stop()


def test_one_stream_decodes_the_same_with_the_kernel_as_without(model, tokenizer, monkeypatch):
    """Tokens and log-probabilities (compared exactly) of one stream at a time, kernel on and off, on the
    same model: each engine start chooses afresh."""
    monkeypatch.setenv("PHALANX_ONE_ROW_KERNEL", "0")
    without, layers_off = one_by_one(model, tokenizer)
    monkeypatch.delenv("PHALANX_ONE_ROW_KERNEL")
    with_kernel, layers_on = one_by_one(model, tokenizer)
    assert layers_off == 0
    assert with_kernel == without
    if one_row_available(torch.float32) and MEASURED_CPU:
        assert layers_on == 2 * 7 + 1  # every layer: 7 per block and the head
    assert make_rows_invariant(model)  # again on the swapped model: still row-invariant
