"""GGUF export of a real tiny run: GGUFReader finds every key, llama.cpp (llama-cpp-python) loads the file,
tokenises like phalanx and computes phalanx's next-token logits."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from phalanx.data.chat_template import CHAT_TEMPLATE, render_chat
from phalanx.data.tokenizer import BOS
from phalanx.export.export import export_run
from phalanx.export.gguf_export import PRE_TOKENIZER, PRE_TOKENIZER_REGEX, write_gguf
from phalanx.models.decoder import Transformer
from phalanx.models.rope import apply_rope, rope_tables
from phalanx.run.gguf_format import interleave_rotary_rows
from phalanx.run.model_loader import LoadedModel, load_model
from tests.conftest import TINY
from tests.helpers import phalanx, train_json

PROMPT = "ROMEO:\nBut, soft! what light through yonder window breaks?  'Tis 1597 -- café, naïve 東京.\n\nJULIET:"
# Max abs logit difference, llama.cpp vs phalanx, with llama.cpp's KV cache in f32. Measured here (see
# the export bench notes): f32 3.6e-7, f16 3.6e-4, bf16 2.1e-3, with logits of std ~0.2. The bounds leave
# headroom for other CPUs; leaving Q and K unpermuted is off by 8e-3 on this barely trained model, so
# the f32 and f16 checks catch it (the f32 one by a factor of ~800). The block-quantised types are
# measured at q8_0 7.3e-3 and q4_0 9.2e-2 (llama.cpp also quantises the activations for those products).
TOLERANCE = {"f32": 1e-5, "f16": 3e-3, "bf16": 2e-2, "q8_0": 3e-2, "q4_0": 0.3}


@pytest.fixture(scope="module")
def run_dir(corpus, runs_root) -> Path:
    """Untied, so the file has an `output` tensor (the tied case is tested below)."""
    summary = train_json(
        *TINY,
        f"data.sources=[{corpus}]",
        f"run.dir={runs_root}",
        "run.name=export-gguf",
        "train.max_steps=4",
        "model.max_seq_len=128",
        "model.tie_embeddings=false",
    )
    return Path(summary["run_dir"])


@pytest.fixture(scope="module")
def exports(run_dir, tmp_path_factory) -> dict[str, Path]:
    """dtype -> model.gguf, each written by the real CLI."""
    root, files = tmp_path_factory.mktemp("gguf"), {}
    for dtype in TOLERANCE:
        report = json.loads(
            phalanx(
                "export", str(run_dir), "--format", "gguf", "--out", str(root / dtype), "--dtype", dtype, "--json"
            ).stdout
        )
        assert sorted(report["files"]) == ["Modelfile", "model.gguf"]
        assert (root / dtype / "Modelfile").read_text().startswith("FROM ./model.gguf\n")
        files[dtype] = root / dtype / "model.gguf"
    return files


def phalanx_logits(model: Transformer, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().numpy()


def field(reader: gguf.GGUFReader, key: str):
    assert key in reader.fields, f"GGUF lacks {key}"
    return reader.fields[key].contents()


@pytest.mark.slow
def test_gguf_keys_and_tensors(run_dir, exports):
    loaded = load_model(run_dir)
    args, tokenizer = loaded.model.args, loaded.tokenizer
    reader = gguf.GGUFReader(exports["f32"])
    assert field(reader, "general.architecture") == "llama"  # other families: test_export_gguf_families.py
    assert "llama.attention.sliding_window" not in reader.fields
    assert field(reader, "general.name") == "export-gguf"
    expected = {
        "llama.context_length": args.max_seq_len,
        "llama.embedding_length": args.dim,
        "llama.block_count": args.n_layers,
        "llama.feed_forward_length": args.ffn_dim,
        "llama.attention.head_count": args.n_heads,
        "llama.attention.head_count_kv": args.n_kv_heads,
        "llama.rope.dimension_count": args.head_size,
        "llama.attention.key_length": args.head_size,
        "llama.attention.value_length": args.head_size,
        "phalanx.family": "llama",  # what the architecture alone does not tell (Mistral is written as llama)
        "llama.vocab_size": args.vocab_size,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    for key, value in expected.items():
        assert field(reader, key) == value, key
    assert field(reader, "llama.rope.freq_base") == pytest.approx(args.rope_theta)
    assert field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(args.norm_eps)
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == PRE_TOKENIZER
    assert field(reader, "tokenizer.ggml.pretokenizer") == PRE_TOKENIZER_REGEX  # for Ollama's own engine
    assert field(reader, "tokenizer.ggml.add_bos_token") is True
    assert field(reader, "tokenizer.chat_template") == CHAT_TEMPLATE

    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    assert len(tokens) == args.vocab_size and all(tokens[i] == t for t, i in vocab.items())
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[:2] == [gguf.TokenType.CONTROL] * 2 and set(types[2:]) == {gguf.TokenType.NORMAL}
    merges = field(reader, "tokenizer.ggml.merges")
    assert len(merges) == len(json.loads(tokenizer.to_str())["model"]["merges"]) > 0
    assert all(len(m.split(" ")) == 2 for m in merges)

    names = {t.name: t for t in reader.tensors}
    per_layer = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_norm", "ffn_norm"]
    assert set(names) == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{p}.weight" for i in range(args.n_layers) for p in per_layer
    }
    f16 = {t.name: t.tensor_type for t in gguf.GGUFReader(exports["f16"]).tensors}
    bf16 = {t.name: t.tensor_type for t in gguf.GGUFReader(exports["bf16"]).tensors}
    F32, F16, BF16 = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    for name, tensor in names.items():  # norms stay f32 whatever --dtype says
        assert (tensor.tensor_type, f16[name], bf16[name]) == ((F32, F32, F32) if "norm" in name else (F32, F16, BF16))
    # The file holds the permuted projection: llama.cpp's own layout.
    wq = loaded.model.layers["0"].attention.wq.weight.detach()
    stored = np.asarray(names["blk.0.attn_q.weight"].data).reshape(wq.shape)
    assert np.array_equal(stored, interleave_rotary_rows(wq, args.n_heads).numpy())
    assert not np.array_equal(stored, wq.numpy())


def test_interleaved_rope_on_permuted_rows_equals_rotate_half():
    """The permutation's claim, checked on its own: interleaved RoPE (pairs 2i, 2i+1) applied to the
    permuted projection gives the rotate_half RoPE of the original projection, permuted the same way."""
    torch.manual_seed(0)
    n_heads, E, D, T = 3, 8, 12, 5
    w_OD, x_TD = torch.randn(n_heads * E, D), torch.randn(T, D)
    cos_TE, sin_TE = rope_tables(E, T, 10000.0)

    half_NTE = apply_rope((x_TD @ w_OD.T).view(T, n_heads, E).transpose(0, 1), cos_TE, sin_TE)
    pairs = (x_TD @ interleave_rotary_rows(w_OD, n_heads).T).view(T, n_heads, E // 2, 2).transpose(0, 1)
    angle = torch.outer(torch.arange(T).float(), 1.0 / 10000.0 ** (torch.arange(0, E, 2).float() / E))
    cos, sin = angle.cos()[None], angle.sin()[None]
    even, odd = pairs[..., 0], pairs[..., 1]
    interleaved_NTE = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)

    back = interleaved_NTE.view(n_heads, T, E // 2, 2).transpose(-1, -2).reshape(n_heads, T, E)
    torch.testing.assert_close(back, half_NTE, rtol=1e-5, atol=1e-5)


def plain_cpu_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load weights into llama.cpp's plain CPU buffers, not its "extra" ones (AMX tiles, repacked
    blocks): a native build enables AMX where the CPU lists it, but a kernel that does not grant the tile
    state (this sandbox's) kills the process with SIGILL at the first quantised matmul. The arithmetic
    checked is the same; only the kernel choice differs."""
    import llama_cpp

    default = llama_cpp.llama_model_default_params

    def params():
        chosen = default()
        chosen.use_extra_bufts = False
        return chosen

    monkeypatch.setattr(llama_cpp.llama.llama_cpp, "llama_model_default_params", params)


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp")
    # llama.cpp keeps its KV cache in f16 by default, which alone costs ~2e-4 here: ask for f32 to
    # compare the weights and the computation.
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=128,
        logits_all=True,
        n_threads=2,
        verbose=False,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
    )
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return logits


@pytest.mark.slow
def test_llama_cpp_tokenises_like_phalanx(run_dir, exports):
    llama_cpp = pytest.importorskip("llama_cpp")
    tokenizer = load_model(run_dir).tokenizer
    llm = llama_cpp.Llama(model_path=str(exports["f32"]), n_ctx=128, vocab_only=True, verbose=False)
    try:
        for text in (PROMPT, "  leading spaces,\ttabs\n\n\nand 12345 digits... ", "O Romeo, Romeo!"):
            assert llm.tokenize(text.encode(), add_bos=True) == [0] + tokenizer.encode(text).ids, text
        ids = [0] + tokenizer.encode(PROMPT).ids
        assert llm.detokenize(ids[1:]).decode() == PROMPT
        # A chat prompt as llama-cpp-python renders it from tokenizer.chat_template: the template's BOS
        # text becomes the one BOS token, as in phalanx.
        chat = render_chat([{"role": "user", "content": "Who art thou?"}], BOS)
        chat_ids = llm.tokenize(chat.encode(), add_bos=False, special=True)
        assert chat_ids == tokenizer.encode(chat).ids and chat_ids.count(0) == 1 and chat_ids[0] == 0
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_llama_cpp_logits_match_phalanx(run_dir, exports, dtype, monkeypatch):
    plain_cpu_buffers(monkeypatch)
    loaded = load_model(run_dir)
    ids = [0] + loaded.tokenizer.encode(PROMPT).ids
    ours, theirs = phalanx_logits(loaded.model, ids), llama_cpp_logits(exports[dtype], ids)
    diff = float(np.abs(ours - theirs).max())
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    print(
        f"llama.cpp {dtype}: max abs diff {diff:.3g} over {ours.shape}, logit std {ours.std():.3g}, "
        f"argmax agrees {agree:.0%}"
    )
    assert diff < TOLERANCE[dtype]
    assert agree > 0.9


@pytest.mark.slow
def test_tied_model_uses_token_embd_for_output(run_dir, tmp_path):
    """A tied model has no `output` tensor; llama.cpp falls back to token_embd, with the same logits."""
    loaded = load_model(run_dir)
    args = loaded.model.args
    torch.manual_seed(0)
    tied = Transformer(type(args)(**{**args.__dict__, "tie_embeddings": True})).eval()
    path = tmp_path / "tied.gguf"
    write_gguf(LoadedModel(tied, loaded.tokenizer, run_dir), path, "tied")
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    ids = [0] + loaded.tokenizer.encode(PROMPT).ids
    diff = float(np.abs(phalanx_logits(tied, ids) - llama_cpp_logits(path, ids)).max())
    print(f"llama.cpp f32 tied (untrained): max abs diff {diff:.3g}")
    assert diff < TOLERANCE["f32"]


@pytest.mark.slow
def test_gguf_from_an_hf_export_is_the_same_model(run_dir, exports, tmp_path):
    """RUN_DIR may be an HF export: converting it gives the very tensors of a direct export."""
    export_run(run_dir, "hf", tmp_path / "hf")
    export_run(tmp_path / "hf", "gguf", tmp_path / "gguf")
    direct = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(exports["f32"]).tensors}
    via_hf = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(tmp_path / "gguf" / "model.gguf").tensors}
    assert direct.keys() == via_hf.keys()
    assert all(np.array_equal(direct[name], via_hf[name]) for name in direct)


@pytest.mark.slow
def test_tokenizer_llama_cpp_would_split_differently_is_refused(run_dir, tmp_path):
    from tokenizers import pre_tokenizers

    from phalanx.errors import PhalanxError

    loaded = load_model(run_dir)
    loaded.tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(PhalanxError, match="GPT-2 split"):
        write_gguf(loaded, tmp_path / "model.gguf", "x")


def test_quantised_types_fall_back_to_f16_for_rows_that_are_not_whole_blocks():
    from phalanx.export.gguf_export import _numpy_in

    whole, ragged = torch.randn(8, 64), torch.randn(8, 48)  # q8_0 blocks hold 32 values
    array, qtype = _numpy_in(whole, "q8_0")
    assert qtype == gguf.GGMLQuantizationType.Q8_0 and array.dtype == np.uint8
    assert np.abs(gguf.quants.dequantize(array, qtype) - whole.numpy()).max() < 0.05
    array, qtype = _numpy_in(ragged, "q4_0")
    assert qtype is None and array.dtype == np.float16


@pytest.mark.slow
def test_quantised_types_are_for_gguf_only(run_dir, tmp_path):
    result = phalanx(
        "export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf"), "--dtype", "q8_0", check=False
    )
    assert result.returncode == 2
    assert "the quantised types are for --format gguf" in result.stderr


@pytest.mark.slow
def test_a_gguf_export_loads_back_as_the_same_model(run_dir, exports):
    """load_model reads a GGUF export (its directory or the file): the f32 file gives phalanx's very
    logits, its vocabulary the same token ids, its chat template back."""
    original = load_model(run_dir)
    ids = [0] + original.tokenizer.encode(PROMPT).ids
    for where in (exports["f32"].parent, exports["f32"]):
        loaded = load_model(where)
        assert loaded.format == "gguf" and loaded.name == "f32"
        assert loaded.model.args == original.model.args
        np.testing.assert_allclose(phalanx_logits(loaded.model, ids), phalanx_logits(original.model, ids), atol=1e-6)
    chat = render_chat([{"role": "user", "content": "Who art thou?"}], BOS)
    for text in (PROMPT, chat, "  leading spaces,\ttabs\n\n\nand 12345 digits... "):
        assert loaded.tokenizer.encode(text).ids == original.tokenizer.encode(text).ids, text
    assert loaded.tokenizer.decode(ids[1:]) == PROMPT
    assert loaded.chat_template == CHAT_TEMPLATE


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_a_quantised_gguf_loads_dequantised(run_dir, exports, dtype):
    original = load_model(run_dir)
    ids = [0] + original.tokenizer.encode(PROMPT).ids
    diff = np.abs(phalanx_logits(load_model(exports[dtype]).model, ids) - phalanx_logits(original.model, ids)).max()
    print(f"phalanx on dequantised {dtype}: max abs diff {diff:.3g}")
    assert 0 < diff < TOLERANCE[dtype]


@pytest.mark.slow
def test_generate_and_serve_take_a_gguf_export(run_dir, exports):
    import httpx

    from tests.serve.serve_helpers import InProcessServer

    greedy = ("ROMEO:", "--max-new-tokens", "12", "--temperature", "0")
    from_run = phalanx("generate", str(run_dir), *greedy).stdout
    assert phalanx("generate", str(exports["f32"].parent), *greedy).stdout == from_run
    with InProcessServer(exports["f32"].parent, slots=2, max_queue=2, name="from-gguf") as live:
        reply = httpx.post(
            f"{live.url}/api/generate",
            json={
                "model": "from-gguf",
                "prompt": "ROMEO:",
                "stream": False,
                "options": {"temperature": 0, "num_predict": 12},
            },
        )
        assert reply.status_code == 200, reply.text
        assert "ROMEO:" + reply.json()["response"] + "\n" == from_run  # generate ends with a newline
        assert httpx.post(f"{live.url}/api/show", json={"model": "from-gguf"}).json()["details"]["format"] == "gguf"


@pytest.mark.slow
def test_a_broken_gguf_is_one_line_and_exit_2(tmp_path, exports):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.gguf").write_bytes(exports["f32"].read_bytes()[:5000])
    result = phalanx("generate", str(broken), "x", check=False)
    assert result.returncode == 2, result.stderr
    assert "is not a readable GGUF file" in result.stderr and "Traceback" not in result.stderr
