"""Serving dtypes on CPU: bfloat16 by default where the CPU has bf16 matrix units (server.pick_device), and
weight-only int8 (phalanx/serve/engines/int8_weights.py, `phalanx serve --quantize int8`), whose layer is close to
its bf16 original and gives each row the same bits at every batch width. In both, a model's greedy
tokens are the same alone and in a busy batch; the real CLI serves with int8 and refuses what it cannot
do with one line."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest
import torch
from serve_helpers import wait_healthy

from phalanx.models.decoder import KVCache, ModelArgs, Transformer
from phalanx.models.token_pass import Cached, DecodeRows
from phalanx.parallel.device import cpu_has_bf16_units
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.engines.int8_weights import Int8WeightLinear, quantize_linear_weights
from phalanx.serve.engines.torch_engine import Engine
from phalanx.serve.server import pick_device
from tests.helpers import phalanx

ARGS = ModelArgs(
    dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=1152, vocab_size=512, max_seq_len=160, rope_theta=10000.0
)


def test_an_int8_layer_is_close_to_its_original_and_the_same_bits_per_row_at_any_width():
    torch.manual_seed(0)
    plain = torch.nn.Linear(1152, 96, bias=False).to(torch.bfloat16)
    layer = Int8WeightLinear(plain)
    assert layer.qweight.dtype == torch.int8 and layer.qweight.shape == (96, 1152)
    x = torch.randn(16, 1, 1152).to(torch.bfloat16)
    with torch.no_grad():
        one_by_one = torch.cat([layer(x[r : r + 1]) for r in range(16)])
        for m in (2, 4, 8, 16):
            assert torch.equal(layer(x[:m]), one_by_one[:m]), m
        ref = plain(x).float()
        error = (layer(x).float() - ref).norm() / ref.norm()
    assert error < 0.02  # per-row scales: about 1% here


def test_a_model_in_bfloat16_is_quantised_except_layers_the_kernel_cannot_take():
    model = Transformer(
        ModelArgs(
            dim=72, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=256, max_seq_len=32, rope_theta=10000.0
        )
    ).to(torch.bfloat16)
    swapped = quantize_linear_weights(model)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if "Linear" in type(m).__name__}
    # dim 72 is not a multiple of 16: layers reducing over it stay bf16; w2 reduces over ffn_dim 160.
    assert kinds["layers.0.feed_forward.w2"] == "Int8WeightLinear"
    assert kinds["layers.0.attention.wq"] == "Linear"
    assert swapped == sum(kind == "Int8WeightLinear" for kind in kinds.values()) == 1  # w2 alone
    with pytest.raises(Exception, match="bfloat16"):
        quantize_linear_weights(Transformer(ARGS))  # float32: the kernel's slow reference path is refused


def test_a_server_defaults_to_bfloat16_where_the_cpu_has_bf16_units():
    expected = torch.bfloat16 if cpu_has_bf16_units() else torch.float32
    assert pick_device("cpu", "auto", serving=True)[1] == expected
    assert pick_device("cpu", "auto")[1] == torch.float32  # generate and local chat keep float32
    assert pick_device("cpu", "float32", serving=True)[1] == torch.float32  # asked for: kept
    assert pick_device("cpu", "auto", quantize="int8")[1] == torch.bfloat16


def test_a_float32_cache_holds_a_bf16_models_keys_and_values_exactly(tokenizer):
    """The engine keeps a bf16 model's KV cache in float32 on CPU (its decode attention runs in float32,
    serve/engines/torch_engine.py): prefill and batched decode over it give the very bits they give over a bf16 cache."""
    torch.manual_seed(0)
    model = Transformer(ARGS).to(torch.bfloat16).eval()
    seqs = [torch.randint(0, ARGS.vocab_size, (n + 1,)) for n in (9, 30, 1)]

    def logits(cache_dtype):
        cache = KVCache(ARGS, len(seqs), 64, dtype=cache_dtype)
        out = []
        with torch.no_grad():
            for row, seq in enumerate(seqs):
                view = type(
                    "Row",
                    (),
                    {"max_len": 64, "layer": lambda self, i, r=row: (cache.k[i][r : r + 1], cache.v[i][r : r + 1])},
                )()
                out.append(model(seq[None, :-1], Cached(view, 0))[0, -1])
            last = torch.stack([seq[-1] for seq in seqs])[:, None]
            out.append(model(last, DecodeRows(cache, torch.tensor([len(s) - 1 for s in seqs])))[:, 0])
        return out

    assert all(torch.equal(a, b) for a, b in zip(logits(torch.float32), logits(torch.bfloat16)))
    engine = Engine(model, tokenizer, slots=2, max_queue=0)
    assert (
        engine.cache.k[0].dtype == torch.float32
        and engine.kv_cache_bytes
        == 4 * 2 * ARGS.n_layers * (2 + 1) * ARGS.n_kv_heads * ARGS.max_seq_len * ARGS.head_size
    )  # k and v, 2 slots and the chunk row


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_greedy_tokens_are_the_same_alone_and_in_a_busy_batch(corpus, weights):
    from phalanx.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer([corpus.read_text()], ARGS.vocab_size)
    torch.manual_seed(0)
    model = Transformer(ARGS).to(torch.bfloat16).eval()
    if weights == "int8":
        assert quantize_linear_weights(model) == 2 * 7 + 1  # every layer: 7 per block and the output head
    requests = [
        (
            [0] + tokenizer.encode(f"ROMEO: line {i} " + "o " * i).ids,
            SamplingOptions(temperature=0, max_tokens=12 + 6 * i),
        )
        for i in range(5)
    ]

    def run(slots):
        engine = Engine(model, tokenizer, slots=slots, max_queue=len(requests))
        if not engine.sized_steps:  # measured at start: oneDNN's bf16 rows vary with the batch on this CPU
            pytest.skip(
                f"this CPU's {weights} products are not row-invariant (no bf16 units), so the engine "
                "runs full-shape steps and promises no alone-or-busy equality"
            )
        engine.start()
        try:
            streams = [engine.submit(ids, options, top_logprobs=1) for ids, options in requests]
            return [(s.text(), s.finish.completion_tokens, s.logprobs) for s in streams]
        finally:
            engine.stop()

    assert run(slots=8) == run(slots=1)


@pytest.mark.slow
def test_serve_quantize_int8_serves_and_refuses_what_it_cannot(served_run, tmp_path):
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "phalanx",
                "serve",
                str(served_run),
                "--port",
                "0",
                "--quantize",
                "int8",
                "--log-level",
                "warning",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"listening on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        wait_healthy(found.group(1), proc, log)
        assert "torch.bfloat16, int8 weights, cpu" in log.read_text()
        reply = httpx.post(
            f"{found.group(1)}/api/generate",
            timeout=60,
            json={
                "model": served_run.name,
                "prompt": "ROMEO:",
                "stream": False,
                "options": {"temperature": 0, "num_predict": 8},
            },
        )
        assert reply.status_code == 200 and reply.json()["eval_count"] >= 1
    finally:
        proc.terminate()
        proc.wait(30)
    bad = phalanx("serve", str(served_run), "--quantize", "int4", check=False, timeout=120)
    assert bad.returncode == 2 and "--quantize must be one of none, int8" in bad.stderr
    bad = phalanx("serve", str(served_run), "--quantize", "int8", "--dtype", "float32", check=False, timeout=120)
    assert bad.returncode == 2 and "bfloat16 activations" in bad.stderr
    bad = phalanx("serve", str(served_run), "--quantize", "int8", "--engine", "llamacpp", check=False, timeout=120)
    assert bad.returncode == 2 and "--quantize is for the torch engine" in bad.stderr
    assert "Traceback" not in bad.stderr
