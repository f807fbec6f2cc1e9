"""GGUF export of every family: Llama, Mistral and Mixtral as llama.cpp's `llama` architecture, Qwen2 as
`qwen2`, Qwen3 as `qwen3`, Qwen3-MoE as `qwen3moe`. Small seeded random models (float32), each loaded in real llama.cpp (llama-cpp-python),
must give phalanx's own logits and greedy tokens; read_gguf must give back the very tensors and ModelArgs.
What llama.cpp cannot run (a sliding window that hides keys, among others) is refused in one line, and a
test keeps checking that llama.cpp still ignores sliding windows, the reason for that refusal."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from phalanx.data.tokenizer import train_tokenizer
from phalanx.errors import PhalanxError
from phalanx.export import gguf_export
from phalanx.export.gguf_export import write_gguf
from phalanx.models.decoder import KVCache, ModelArgs, Transformer
from phalanx.models.token_pass import Cached
from phalanx.run.gguf_format import halve_rotary_rows, interleave_rotary_rows, read_gguf
from phalanx.run.model_loader import LoadedModel, load_model
from tests.conftest import TINY
from tests.helpers import phalanx, train_json

MAX_SEQ_LEN = 64
BASE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=384, max_seq_len=MAX_SEQ_LEN)
# name -> (ModelArgs overrides, llama.cpp architecture)
FAMILIES = {
    "llama": (dict(family="llama"), "llama"),
    # Llama 3.1 RoPE scaling that bites within the prompt (16 original positions), and no output tensor.
    "llama-scaled-tied": (
        dict(family="llama", rope_scaling_factor=8.0, rope_original_max_seq_len=16, tie_embeddings=True),
        "llama",
    ),
    # A window of max_seq_len hides no key within the context: exportable (see the refusals below).
    "mistral": (dict(family="mistral", sliding_window=MAX_SEQ_LEN), "llama"),
    "qwen2": (dict(family="qwen2", qkv_bias=True), "qwen2"),
    # head_dim 32, not dim / n_heads = 16: llama.cpp must take it from key_length.
    "qwen3": (dict(family="qwen3", qk_norm=True, head_dim=32), "qwen3"),
    # Mixtures of experts (models/moe.py): experts stacked in ffn_{gate,up,down}_exps, the router ffn_gate_inp.
    "mixtral": (dict(family="mixtral", n_experts=4, n_experts_per_token=2, router_aux_loss_coef=0.02), "llama"),
    "qwen3_moe": (
        dict(family="qwen3_moe", qk_norm=True, head_dim=32, n_experts=4, n_experts_per_token=2, expert_ffn_dim=64),
        "qwen3moe",
    ),
}
PROMPT = "ROMEO:\nBut, soft! what light through yonder window breaks?"
NEW_TOKENS = 16
# Max abs logit difference, llama.cpp vs phalanx, f32 weights and KV cache: measured 2.4e-6 to 2.9e-6
# here for every dense family, 2.9e-6 (mixtral) and 3.3e-6 (qwen3_moe), with logits of std ~0.8. Q/K rows in the other RoPE layout than the
# architecture's (permuted for qwen2/qwen3, or not for llama) are off by 2.2 to 2.8.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tokenizer(corpus):
    """phalanx's own byte-level BPE with its special tokens (BOS 0, EOS 1), trained as a run trains it."""
    return train_tokenizer([corpus.read_text()], BASE["vocab_size"])


def random_model(seed: int = 0, **overrides) -> Transformer:
    """Seeded random weights of std 0.1, so the logits spread and greedy choices have clear margins; norm
    weights and biases random too (they start at ones and zeros), so a norm or bias that llama.cpp read
    wrongly, or not at all, would change the output."""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def exports(tokenizer, tmp_path_factory) -> dict[str, tuple[Transformer, Path]]:
    root = tmp_path_factory.mktemp("gguf-families")
    out = {}
    for seed, (name, (overrides, _)) in enumerate(FAMILIES.items()):
        model = random_model(seed, **overrides)
        write_gguf(LoadedModel(model, tokenizer, root), root / f"{name}.gguf", name)
        out[name] = model, root / f"{name}.gguf"
    return out


def prompt_ids(tokenizer) -> list[int]:
    return [0] + tokenizer.encode(PROMPT).ids


@torch.no_grad()
def phalanx_greedy(model: Transformer, ids: list[int], n: int) -> tuple[list[int], float]:
    """(n greedy tokens by prefill and cached decode steps, the smallest top-2 logit margin among them)."""
    cache = KVCache(model.args, 1, MAX_SEQ_LEN)
    logits_V = model(torch.tensor([ids]), Cached(cache))[0, -1]
    tokens, margin, pos = [], float("inf"), len(ids)
    for _ in range(n):
        top = logits_V.topk(2).values
        margin = min(margin, float(top[0] - top[1]))
        tokens.append(int(logits_V.argmax()))
        logits_V = model(torch.tensor([[tokens[-1]]]), Cached(cache, pos))[0, -1]
        pos += 1
    return tokens, margin


@torch.no_grad()
def phalanx_logits(model: Transformer, ids: list[int]) -> np.ndarray:
    return model(torch.tensor([ids]))[0].numpy()


def llama(path: Path):
    """llama.cpp's high-level Llama on `path`: f32 KV cache (its f16 default alone costs ~2e-4), two
    threads, and plain CPU buffers (test_export_gguf.plain_cpu_buffers: this sandbox's kernel kills AMX)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    default = llama_cpp.llama_model_default_params

    def plain_buffers():
        params = default()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama.llama_cpp.llama_model_default_params = plain_buffers
    try:
        return llama_cpp.Llama(
            model_path=str(path),
            n_ctx=MAX_SEQ_LEN,
            logits_all=True,
            n_threads=2,
            verbose=False,
            type_k=llama_cpp.GGML_TYPE_F32,
            type_v=llama_cpp.GGML_TYPE_F32,
        )
    finally:
        llama_cpp.llama.llama_cpp.llama_model_default_params = default


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    llm = llama(path)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def llama_cpp_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    llm = llama(path)
    try:
        tokens = []
        for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            tokens.append(token)
            if len(tokens) == n:
                break
        return tokens
    finally:
        llm.close()


@pytest.mark.slow  # needs llama-cpp-python
@pytest.mark.parametrize("name", list(FAMILIES))
def test_llama_cpp_computes_phalanxs_logits_and_greedy_tokens(exports, tokenizer, name):
    model, path = exports[name]
    ids = prompt_ids(tokenizer)
    diff = float(np.abs(phalanx_logits(model, ids) - llama_cpp_logits(path, ids)).max())
    ours, margin = phalanx_greedy(model, ids, NEW_TOKENS)
    theirs = llama_cpp_greedy(path, ids, NEW_TOKENS)
    print(f"{name}: max abs logit diff {diff:.3g}, smallest greedy margin {margin:.3g}, tokens {ours}")
    assert diff < TOLERANCE
    assert margin > 100 * TOLERANCE  # else equal tokens would prove little
    assert len(set(ours)) > 1  # a model that repeats one token would not tell positions apart
    assert theirs == ours


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_file_holds_the_architectures_own_tensors_and_keys(exports, name):
    model, path = exports[name]
    args, (_, arch) = model.args, FAMILIES[name]
    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items()}
    assert fields["general.architecture"] == arch
    assert fields["phalanx.family"] == args.family
    assert fields[f"{arch}.attention.key_length"] == fields[f"{arch}.attention.value_length"] == args.head_size
    assert fields[f"{arch}.rope.dimension_count"] == args.head_size
    assert fields.get(f"{arch}.attention.sliding_window") == args.sliding_window

    # Every tensor is one the gguf package lists for this architecture (with .weight or .bias).
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    allowed = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[arch_id] for i in range(args.n_layers)}
    tensors = {t.name: t for t in reader.tensors}
    assert {n.rsplit(".", 1)[0] for n in tensors} <= allowed
    assert ("output.weight" in tensors) != args.tie_embeddings
    assert ("rope_freqs.weight" in tensors) == (args.rope_scaling_factor != 1)
    for i in range(args.n_layers):
        assert all((f"blk.{i}.attn_{p}.bias" in tensors) == args.qkv_bias for p in "qkv")
        assert all((f"blk.{i}.attn_{p}_norm.weight" in tensors) == args.qk_norm for p in "qk")

    # Q/K rows (and biases) are interleaved for llama's RoPE layout only; qwen2/qwen3 rotate like phalanx.
    attention = model.layers["0"].attention
    for proj, heads in (("q", args.n_heads), ("k", args.n_kv_heads)):
        for kind in ("weight", "bias") if args.qkv_bias else ("weight",):
            ours = getattr(getattr(attention, f"w{proj}"), kind).detach()
            stored = torch.tensor(np.asarray(tensors[f"blk.0.attn_{proj}.{kind}"].data)).reshape(ours.shape)
            expected = interleave_rotary_rows(ours, heads) if arch == "llama" else ours
            assert torch.equal(stored, expected), (proj, kind)
            assert torch.equal(halve_rotary_rows(interleave_rotary_rows(ours, heads), heads), ours)
            assert not torch.equal(interleave_rotary_rows(ours, heads), ours)  # so the check above means something


@pytest.mark.parametrize("name", list(FAMILIES))
def test_read_gguf_gives_back_the_model(exports, tokenizer, name):
    model, path = exports[name]
    back, back_tokenizer, _ = read_gguf(path)
    assert back.args == model.args
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert (back.output.weight is back.tok_embeddings.weight) == model.args.tie_embeddings
    ids = prompt_ids(tokenizer)
    assert [0] + back_tokenizer.encode(PROMPT).ids == ids
    np.testing.assert_array_equal(phalanx_logits(back, ids), phalanx_logits(model, ids))


def test_the_model_loader_reads_a_qwen3_export(exports):
    model, path = exports["qwen3"]
    loaded = load_model(path)
    assert loaded.format == "gguf" and loaded.model.args == model.args


REFUSED = {
    "a sliding window of 8 tokens": dict(family="mistral", sliding_window=8),
    "a sliding window of 63 tokens": dict(family="qwen2", sliding_window=MAX_SEQ_LEN - 1),
    "no q/k norms": dict(family="qwen3"),
    "with q/k norms": dict(family="llama", qk_norm=True),
    "head_dim 32 with 4 heads and dim 64": dict(family="qwen2", head_dim=32),
    "Llama 3.1 RoPE scaling": dict(family="qwen3", qk_norm=True, rope_scaling_factor=8.0),
    "dense first layers": dict(family="qwen3_moe", qk_norm=True, n_experts=4, n_experts_per_token=2, n_dense_layers=1),
}


@pytest.mark.parametrize("reason", list(REFUSED))
def test_what_llama_cpp_cannot_run_is_refused_in_one_line(tokenizer, tmp_path, reason):
    model = random_model(**REFUSED[reason])
    with pytest.raises(PhalanxError, match=reason) as refused:
        write_gguf(LoadedModel(model, tokenizer, tmp_path), tmp_path / "model.gguf", "x")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "model.gguf").exists()


@pytest.mark.slow  # needs llama-cpp-python
def test_llama_cpp_applies_no_sliding_window(tokenizer, tmp_path, monkeypatch):
    """Why a window shorter than the context is refused: written anyway (with llama.attention.sliding_window
    set), llama.cpp computes full causal attention, not the windowed model. Should a llama.cpp release
    start applying the window, this fails, and the refusal can go."""
    window = 8
    windowed = random_model(family="mistral", sliding_window=window)
    full = Transformer(dataclasses.replace(windowed.args, sliding_window=None)).eval()
    full.load_state_dict(windowed.state_dict())
    monkeypatch.setattr(gguf_export, "check_llama_cpp_computes", lambda args: None)
    path = tmp_path / "windowed.gguf"
    write_gguf(LoadedModel(windowed, tokenizer, tmp_path), path, "windowed")
    assert gguf.GGUFReader(path).fields["llama.attention.sliding_window"].contents() == window

    ids = prompt_ids(tokenizer)
    assert len(ids) > 2 * window
    theirs = llama_cpp_logits(path, ids)
    to_full = float(np.abs(theirs - phalanx_logits(full, ids)).max())
    to_windowed = np.abs(theirs - phalanx_logits(windowed, ids)).max(-1)
    print(f"llama.cpp vs full attention {to_full:.3g}; vs windowed, per position {np.round(to_windowed, 3)}")
    assert to_full < TOLERANCE
    assert to_windowed[:window].max() < TOLERANCE  # the window hides nothing yet
    assert to_windowed[window:].max() > 1e-2


@pytest.mark.slow  # trains a run; needs llama-cpp-python
def test_the_cli_exports_a_trained_qwen3_run(corpus, runs_root, tmp_path):
    """`phalanx export --format gguf` on a run of another family than Llama: the file is qwen3, llama.cpp
    decodes as phalanx does, and the export loads back as the run's model."""
    summary = train_json(
        *TINY,
        f"data.sources=[{corpus}]",
        f"run.dir={runs_root}",
        "run.name=export-gguf-qwen3",
        "train.max_steps=2",
        "model.family=qwen3",
        "model.qk_norm=true",
        "model.qkv_bias=true",
        "model.head_dim=32",
    )
    run = load_model(Path(summary["run_dir"]))
    phalanx("export", summary["run_dir"], "--format", "gguf", "--out", str(tmp_path / "gguf"), "--json")
    path = tmp_path / "gguf" / "model.gguf"
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "qwen3"
    ids = prompt_ids(run.tokenizer)
    # Two steps of training mostly repeat one token, so the logits at every prompt position are compared too.
    assert np.abs(llama_cpp_logits(path, ids) - phalanx_logits(run.model, ids)).max() < TOLERANCE
    assert llama_cpp_greedy(path, ids, NEW_TOKENS) == phalanx_greedy(run.model, ids, NEW_TOKENS)[0]
    assert load_model(path).model.args == run.model.args
