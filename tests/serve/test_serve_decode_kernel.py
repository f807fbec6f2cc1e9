"""The decode kernel (serve/engines/decode_kernel.py): a decode step's linear products read each packed weight
as one stream and give every row exactly the bits oneDNN gives it, so the engine may use the kernel without
changing any request's tokens. Measured equal on AMD EPYC (Zen 4, AVX-512 with bf16, no AMX); elsewhere
the engine checks at start and keeps oneDNN where the bits differ, which these tests hold it to as well."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phalanx.models.decoder import ModelArgs
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.engines.decode_kernel import decode_kernel_available, pack_panels, panel_linear
from phalanx.serve.engines.row_invariant import RowInvariantLinear, make_rows_invariant, panels_agree
from phalanx.serve.engines.torch_engine import Engine, step_span

ARGS = ModelArgs(
    dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=1152, vocab_size=512, max_seq_len=160, rope_theta=10000.0
)  # ffn 1152: w2's reduction is cut in two chunks (row_invariant.py), each its own panels
DTYPES = [torch.float32, torch.bfloat16]
# Where oneDNN's sums were measured to be the kernel's; on other CPUs only consistency is required.
MEASURED_CPU = "AuthenticAMD" in Path("/proc/cpuinfo").read_text() and not torch.cpu._is_amx_tile_supported()


def kernel_or_skip(dtype: torch.dtype) -> None:
    if not decode_kernel_available(dtype):
        pytest.skip(f"no decode kernel for {dtype} here (no AVX-512, avx512_bf16 or compiler)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_computes_the_product_for_any_shape(dtype):
    """Odd inputs (a zero pads the last bf16 pair), outputs not a multiple of the 64-output panel, long rows,
    row counts that are not a multiple of the four the kernel takes at a time."""
    kernel_or_skip(dtype)
    generator = torch.Generator().manual_seed(0)
    for k, n, rows in [(96, 100, 1), (501, 64, 3), (768, 2304, 16), (1000, 130, 7), (2048, 5, 2), (64, 64, 0)]:
        weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype)
        x = torch.randn(rows, k, generator=generator).to(dtype)
        got = panel_linear(x, pack_panels(weight), n)
        assert got.shape == (rows, n) and got.dtype == dtype
        exact = x.double() @ weight.double().T
        atol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=atol)
        one_by_one = [panel_linear(x[r : r + 1], pack_panels(weight), n) for r in range(rows)]
        assert rows == 0 or torch.equal(torch.cat(one_by_one), got)  # a row's bits are its own


def test_the_kernel_refuses_panels_of_another_shape():
    kernel_or_skip(torch.float32)
    panels = pack_panels(torch.randn(64, 96))
    with pytest.raises(RuntimeError, match="panels of another shape"):
        panel_linear(torch.randn(1, 128), panels, 64)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        panel_linear(torch.randn(96, 2).T, panels, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_decode_width_gets_the_bits_onednn_gives(dtype):
    kernel_or_skip(dtype)
    torch.manual_seed(0)
    for k, n in [(96, 192), (768, 2304), (1152, 96), (2100, 64)]:  # one chunk, one, two, three
        linear = RowInvariantLinear(torch.nn.Linear(k, n, bias=False).to(dtype))
        x = torch.randn(16, 1, k).to(dtype)  # (rows, 1, features), as a decode step has them
        with torch.no_grad():
            onednn = linear(x)
            linear.pack_panels()
            by_width = {w: torch.cat([linear(x[r : r + w]) for r in range(0, 16, w)]) for w in (1, 2, 4, 8, 16)}
        same = all(torch.equal(got, onednn) for got in by_width.values())
        if MEASURED_CPU:
            assert same, (k, n)
            assert panels_agree(linear)
        else:  # another CPU: what the engine's check decides must be what the bits say
            assert panels_agree(linear) == same


def test_the_check_refuses_a_kernel_that_sums_in_other_blocks():
    """The kernel summing in blocks of 256 inputs, where oneDNN sums 512: the engine's check must see it."""
    kernel_or_skip(torch.float32)
    torch.manual_seed(0)
    linear = RowInvariantLinear(torch.nn.Linear(768, 256, bias=False))
    linear.pack_panels(block=256)
    assert not panels_agree(linear)
    if MEASURED_CPU:
        linear.pack_panels()
        assert panels_agree(linear)


class Cache:
    """A decode step's view of a KV cache, as torch_engine's _StepCache gives DecodeRows."""

    def __init__(self, k, v, width: int, span: int):
        self.max_len, self._k, self._v = span, k[:width, :, :span], v[:width, :, :span]

    def layer(self, i):
        return self._k, self._v


class Layer:
    layer_index = 0

    def __init__(self, window):
        self.sliding_window = window


@pytest.mark.parametrize(
    "heads, kv_heads, e, f, window", [(12, 12, 64, 64, None), (6, 2, 16, 16, 5), (4, 4, 24, 40, None)]
)
def test_decode_attention_in_the_kernel_is_close_to_torchs_and_each_row_its_own(heads, kv_heads, e, f, window):
    """Against DecodeRows' batched products (grouped-query heads, a sliding window, MLA's wider values):
    close; and each row's output the very same bits alone as among rows at other positions, at any span."""
    from phalanx.models.token_pass import DecodeRows
    from phalanx.serve.engines.decode_kernel import KernelDecodeRows

    kernel_or_skip(torch.float32)
    generator = torch.Generator().manual_seed(0)
    slots, length = 4, 48
    k = torch.randn(slots, kv_heads, length, e, generator=generator)
    v = torch.randn(slots, kv_heads, length, f, generator=generator)
    q = torch.randn(slots, heads, 1, e, generator=generator)
    new_k = torch.randn(slots, kv_heads, 1, e, generator=generator)
    new_v = torch.randn(slots, kv_heads, 1, f, generator=generator)
    positions = torch.tensor([3, 40, 0, 17])

    def attend(rows_class, width, span, rows=slice(None)):
        ck, cv = k.clone(), v.clone()
        step = rows_class(Cache(ck[rows], cv[rows], width, span), positions[rows][:width].contiguous())
        return step.attend(Layer(window), q[rows][:width], new_k[rows][:width], new_v[rows][:width])

    kernel = attend(KernelDecodeRows, slots, 44)
    torch.testing.assert_close(kernel, attend(DecodeRows, slots, 44), rtol=1e-5, atol=1e-5)
    for row in range(slots):  # alone, over the span the engine would give the row alone
        alone = attend(KernelDecodeRows, 1, step_span(int(positions[row]) + 1, length), rows=slice(row, row + 1))
        assert torch.equal(alone[0], kernel[row])


def prompt(tokenizer, i: int) -> list[int]:
    return [0] + tokenizer.encode("ROMEO: " + "but soft " * (i % 3) + f"line {i}").ids


def served(model, tokenizer) -> tuple[list, int]:
    """Three requests at once on a 4-slot engine (decode widths 4, 2, 1 as they finish), and how many layers
    took the kernel."""
    e = Engine(model, tokenizer, slots=4, max_queue=4)
    kernel_layers = sum(1 for m in model.modules() if isinstance(m, RowInvariantLinear) and m._panels is not None)
    e.start()
    try:
        options = [SamplingOptions(temperature=0, max_tokens=20 + 15 * i) for i in range(3)]
        streams = [e.submit(prompt(tokenizer, i), options[i], top_logprobs=2) for i in range(3)]
        return [(s.text(), s.finish.completion_tokens, s.logprobs) for s in streams], kernel_layers
    finally:
        e.stop()


def test_the_engine_decodes_the_same_with_the_kernel_as_without(model, tokenizer, monkeypatch):
    """Kernel off and on, on the same model (each engine start chooses afresh): the same tokens, and
    log-probabilities equal up to the attention's own summation order (the products' bits are the same)."""
    monkeypatch.setenv("PHALANX_DECODE_KERNEL", "0")
    without, layers_off = served(model, tokenizer)
    monkeypatch.delenv("PHALANX_DECODE_KERNEL")
    with_kernel, layers_on = served(model, tokenizer)
    assert layers_off == 0
    assert [(text, n) for text, n, _ in with_kernel] == [(text, n) for text, n, _ in without]
    for (*_, got), (*_, expected) in zip(with_kernel, without):
        assert [e["token"] for e in got] == [e["token"] for e in expected]
        assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in expected], abs=1e-4)
    if decode_kernel_available(torch.float32) and MEASURED_CPU:
        assert layers_on == 2 * 7 + 1  # every layer: 7 per block and the head
    assert make_rows_invariant(model)  # again on the swapped model: still row-invariant


def test_the_kernel_is_built_once_and_kept_for_the_next_process(tmp_path):
    """Built in a folder of its own (a killed build leaves no lock behind) and kept under the cache folder;
    the next process loads the kept library and builds nothing."""
    kernel_or_skip(torch.float32)
    run = [
        sys.executable,
        "-c",
        "import torch; from phalanx.serve.engines.decode_kernel import _compiled as c; print(c())",
    ]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    (tmp_path / "phalanx" / "decode_kernel" / "tmp-killed-build").mkdir(parents=True)  # a build killed halfway
    (tmp_path / "phalanx" / "decode_kernel" / "tmp-killed-build" / "lock").touch()
    assert subprocess.run(run, env=env, capture_output=True, text=True, timeout=300).stdout.strip() == "True"
    kept = list((tmp_path / "phalanx" / "decode_kernel").glob("phalanx_decode_kernel-*.so"))
    assert len(kept) == 1
    built_at = kept[0].stat().st_mtime_ns
    assert subprocess.run(run, env=env, capture_output=True, text=True, timeout=300).stdout.strip() == "True"
    assert kept[0].stat().st_mtime_ns == built_at
    assert sorted(p.name for p in kept[0].parent.iterdir()) == sorted([kept[0].name, "tmp-killed-build"])
