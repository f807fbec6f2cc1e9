"""The native decode block (serve/engines/decode_block.py): a decode step's dense layers, each in one call,
compute what the module's own forward computes (up to float rounding), write the same keys and values,
and give each row the very same bits alone as among other rows at other positions and spans."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from phalanx.models.decoder import KVCache, ModelArgs, Transformer
from phalanx.serve.engines.decode_block import NativeDecodeRows, decode_step_rows, native_blocks
from phalanx.serve.engines.decode_kernel import KernelDecodeRows, decode_kernel_available
from phalanx.serve.engines.row_invariant import make_rows_invariant
from phalanx.serve.engines.torch_engine import _StepCache, step_span

LLAMA = ModelArgs(
    dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=1152, vocab_size=256, max_seq_len=96, rope_theta=10000.0
)  # ffn 1152: w2's reduction is two chunks, summed as torch sums them
FAMILIES = {
    "llama": LLAMA,
    "qwen2": dataclasses.replace(LLAMA, qkv_bias=True, ffn_dim=160),
    "qwen3": dataclasses.replace(LLAMA, qk_norm=True, head_dim=32, ffn_dim=160),
    "mistral": dataclasses.replace(LLAMA, sliding_window=7, n_kv_heads=6, ffn_dim=160),
}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.1}  # logits; bf16: a rounding flip early on carries through


def model_for(args: ModelArgs, dtype: torch.dtype) -> Transformer:
    if not decode_kernel_available(dtype):
        pytest.skip(f"no decode kernel for {dtype} here")
    torch.manual_seed(0)
    model = Transformer(args).to(dtype).eval()
    with torch.no_grad():  # biases and norm weights away from their zeros and ones, so that they count
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    assert make_rows_invariant(model)
    return model


def step(model, rows_class, cache, tokens, positions, span, **extra) -> torch.Tensor:
    width = tokens.shape[0]
    with torch.inference_mode():
        return model(tokens.view(width, 1), rows_class(_StepCache(cache, width, span), positions, **extra))[:, 0]


def filled_cache(args: ModelArgs, rows: int) -> KVCache:
    cache = KVCache(args, rows, args.max_seq_len, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    for layer in cache.k + cache.v:
        layer.copy_(torch.randn(layer.shape, generator=generator))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_native_block_computes_what_the_modules_compute(family, dtype):
    args = FAMILIES[family]
    model = model_for(args, dtype)
    blocks = native_blocks(model)
    assert sorted(blocks) == list(range(args.n_layers))
    tokens, positions = torch.tensor([5, 17, 200, 3]), torch.tensor([3, 40, 0, 17])
    ours, theirs = filled_cache(args, 4), filled_cache(args, 4)
    native = step(model, NativeDecodeRows, ours, tokens, positions, 48, blocks=blocks)
    modules = step(model, KernelDecodeRows, theirs, tokens, positions, 48)
    torch.testing.assert_close(native.float(), modules.float(), rtol=0, atol=TOLERANCE[dtype])
    assert torch.equal(native.argmax(-1), modules.argmax(-1))
    for got, expected in zip(ours.k + ours.v, theirs.k + theirs.v):  # the same positions written, alike
        torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE[dtype] / 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_each_row_gets_the_same_bits_alone_as_in_company(family, dtype):
    args = FAMILIES[family]
    model = model_for(args, dtype)
    blocks = native_blocks(model)
    tokens, positions = torch.tensor([5, 17, 200, 3]), torch.tensor([3, 40, 0, 17])
    together = step(model, NativeDecodeRows, filled_cache(args, 4), tokens, positions, 64, blocks=blocks)
    for row in range(4):
        cache = filled_cache(args, 4)  # the row's own cache row, moved to row 0 as the engine would pack it
        for layer in cache.k + cache.v:
            layer[0] = layer[row].clone()
        span = step_span(int(positions[row]) + 1, args.max_seq_len)
        alone = step(
            model, NativeDecodeRows, cache, tokens[row : row + 1], positions[row : row + 1], span, blocks=blocks
        )
        assert torch.equal(alone[0], together[row]), row


def test_blocks_it_does_not_cover_keep_their_own_forward(monkeypatch):
    """A mixture of experts' layers run their modules; PHALANX_DECODE_BLOCK=0 turns the blocks off."""
    moe = dataclasses.replace(LLAMA, n_experts=4, n_experts_per_token=2, expert_ffn_dim=64, n_dense_layers=1)
    model = model_for(moe, torch.float32)
    blocks = native_blocks(model)
    assert sorted(blocks) == [0]  # the dense first layer only
    tokens, positions = torch.tensor([5, 17]), torch.tensor([3, 40])
    native = step(model, NativeDecodeRows, filled_cache(moe, 2), tokens, positions, 48, blocks=blocks)
    modules = step(model, KernelDecodeRows, filled_cache(moe, 2), tokens, positions, 48)
    torch.testing.assert_close(native, modules, rtol=0, atol=1e-4)
    assert decode_step_rows(model, kernel=True).func is NativeDecodeRows
    monkeypatch.setenv("PHALANX_DECODE_BLOCK", "0")
    assert decode_step_rows(model, kernel=True) is KernelDecodeRows


def test_a_block_refuses_rows_positions_or_tables_of_the_wrong_shape():
    args = FAMILIES["llama"]
    model = model_for(args, torch.float32)
    block = native_blocks(model)[0]
    cache = filled_cache(args, 2)
    x, head = torch.randn(2, args.dim), args.dim // args.n_heads
    cos, sin = torch.randn(2, head), torch.randn(2, head)
    keys, values = cache.layer(0)
    with pytest.raises(RuntimeError, match=r"positions: \(B,\) int64"):
        block.forward(x, torch.tensor([3]), cos, sin, keys[:2], values[:2])
    with pytest.raises(RuntimeError, match="RoPE tables"):
        block.forward(x, torch.tensor([3, 4]), cos[:1], sin[:1], keys[:2], values[:2])
    with pytest.raises(RuntimeError, match="within the step's cache span"):
        block.forward(x, torch.tensor([3, args.max_seq_len]), cos, sin, keys[:2], values[:2])
    assert block.forward(x, torch.tensor([3, 4]), cos, sin, keys[:2], values[:2]).shape == (2, args.dim)
