"""Pretrained checkpoints of every family, made by transformers' own classes (tiny and random): phalanx
loads them (one file or shards) and computes transformers' logits and greedy tokens; exporting the loaded
model gives the same tensors bit for bit, as the same architecture; bad directories are refused in one line.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers

from phalanx.data.tokenizer import BOS, EOS
from phalanx.errors import PhalanxError
from phalanx.export.hf import write_hf_export
from phalanx.models.decoder import KVCache
from phalanx.models.families import SUPPORTED_ARCHITECTURES
from phalanx.models.token_pass import Cached
from phalanx.run.hf_format import INDEX_FILE, check_hf_weights, hf_weight_map, is_hf_export, read_hf_args
from phalanx.run.model_loader import load_model
from tests.helpers import phalanx

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT_LEN, NEW_TOKENS = 128, 10, 12
SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
)
# Llama 3.1's scaling, with an original context of 16 positions so that it bites within the test's tokens.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# name -> (config class, its settings beyond SHAPE, phalanx's family)
CASES = {
    "llama": ("LlamaConfig", {}, "llama"),
    "llama3.1-rope": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE}, "llama"),
    "llama3.2-tied": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}, "llama"),
    # A window of 5 keys, well inside the prompt and the generated tokens.
    "mistral-window": ("MistralConfig", {"sliding_window": 5}, "mistral"),
    "qwen2": ("Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "qwen2"),
    # head_dim 32 where hidden / heads is 16; tied like the small Qwen3s.
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}, "qwen3"),
}


def word_tokenizer(vocab_size: int = VOCAB) -> Tokenizer:
    """A word-level tokenizer of `vocab_size` ids with phalanx's BOS and EOS names (phalanx's tokenizer
    reader asks for those names, data/tokenizer.py special_ids)."""
    words = [BOS, EOS, "<unk>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([BOS, EOS])
    return tokenizer


def hf_model(case: str):
    """transformers' model of the case, every parameter random (biases and norm weights too, so a tensor
    mapped to the wrong place shows in the logits)."""
    config_class, extra, _ = CASES[case]
    config = getattr(transformers, config_class)(**SHAPE, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def save_checkpoint(model, out: Path, max_shard_size: str | None = None) -> Path:
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    (out / "tokenizer.json").write_text(word_tokenizer().to_str())
    return out


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    """(case, transformers' model, its directory with one model.safetensors, the same sharded)."""
    model = hf_model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    single = save_checkpoint(model, root / "single")
    sharded = save_checkpoint(model, root / "sharded", max_shard_size="40KB")
    return request.param, model, single, sharded


def prompt_ids(n: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, n), generator=torch.Generator().manual_seed(1))


def test_logits_match_transformers(checkpoint):
    case, model, single, _ = checkpoint
    loaded = load_model(single)
    assert loaded.model.args.family == CASES[case][2] and loaded.format == "safetensors"
    ids = prompt_ids(24)  # past the sliding window and the scaled RoPE's original context
    with torch.no_grad():
        theirs, ours = model(ids).logits, loaded.model(ids)
    diff = (theirs - ours).abs().max().item()
    print(f"{case}: max abs logit diff {diff:.3g}, logit std {ours.std().item():.3g}")
    assert diff < 1e-5


def test_greedy_generation_through_the_kv_cache_matches_transformers(checkpoint):
    case, model, single, _ = checkpoint
    phalanx_model = load_model(single).model
    ids = prompt_ids()
    with torch.no_grad():
        theirs = model.generate(
            ids,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )[0, PROMPT_LEN:].tolist()
        cache = KVCache(phalanx_model.args, 1, PROMPT_LEN + NEW_TOKENS)
        logits = phalanx_model(ids, Cached(cache))
        ours, position = [], PROMPT_LEN
        while len(ours) < NEW_TOKENS:
            logits[..., 1] = float("-inf")  # as min_new_tokens keeps EOS (id 1) out of transformers' choice
            ours.append(int(logits[0, -1].argmax()))
            logits = phalanx_model(torch.tensor([[ours[-1]]]), Cached(cache, position))
            position += 1
    assert ours == theirs, case


def test_sharded_checkpoint_loads_the_same_weights(checkpoint):
    _, _, single, sharded = checkpoint
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and (sharded / INDEX_FILE).is_file() and not (sharded / "model.safetensors").exists()
    assert is_hf_export(sharded)
    assert {p.name for p in hf_weight_map(sharded).values()} == set(shards)
    args = read_hf_args(sharded)
    assert set(check_hf_weights(sharded, args)) == set(check_hf_weights(single, args))
    one, many = load_model(single).model.state_dict(), load_model(sharded).model.state_dict()
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            found |= {name: f.get_tensor(name) for name in f.keys()}
    return found


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000], ids=["one-file", "sharded"])
def test_export_is_bit_identical_and_the_same_architecture(checkpoint, max_shard_bytes, tmp_path):
    case, model, single, _ = checkpoint
    loaded = load_model(single)
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    written = write_hf_export(loaded, tmp_path, "f32", **kwargs)
    assert all(p.exists() for p in written) and (tmp_path / INDEX_FILE).exists() == (max_shard_bytes is not None)
    if max_shard_bytes is not None:
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        assert all((tmp_path / shard).stat().st_size <= max_shard_bytes + 1000 for shard in shards)  # + header
        assert index["metadata"]["total_size"] == 4 * loaded.model.num_params()

    original, exported = tensors(single), tensors(tmp_path)
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], original[name]) for name in original)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__] and config["model_type"] == model.config.model_type
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reloaded) is type(model)
    ids = prompt_ids(24)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    assert load_model(tmp_path).model.args == loaded.model.args


# ---- bad directories: one PhalanxError line each


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """One family's directories (single, sharded), to copy and break: the refusals are the same for all."""
    model, root = hf_model("qwen3"), tmp_path_factory.mktemp("qwen3-refusals")
    return save_checkpoint(model, root / "single"), save_checkpoint(model, root / "sharded", max_shard_size="40KB")


@pytest.fixture
def qwen3_copy(qwen3_dirs, tmp_path) -> tuple[Path, Path]:
    return tuple(shutil.copytree(d, tmp_path / d.name) for d in qwen3_dirs)


def refusal(path: Path) -> str:
    with pytest.raises(PhalanxError) as err:
        load_model(path)
    message = str(err.value)
    assert "\n" not in message
    return message


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | changes))


def test_unknown_architecture_is_named_with_the_supported_ones(qwen3_copy):
    single, _ = qwen3_copy
    edit_config(single, model_type="gemma2", architectures=["Gemma2ForCausalLM"])
    message = refusal(single)
    assert "'gemma2'" in message and "Gemma2ForCausalLM" in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)


def test_missing_shard_is_named(qwen3_copy):
    _, sharded = qwen3_copy
    victim = sorted(sharded.glob("model-00002-of-*.safetensors"))[0]
    victim.unlink()
    message = refusal(sharded)
    assert f"lacks the shard {victim.name}" in message and INDEX_FILE in message


def test_shape_disagreeing_with_config_is_named(qwen3_copy):
    single, sharded = qwen3_copy
    for directory in (single, sharded):
        edit_config(directory, intermediate_size=96)
        message = refusal(directory)
        assert "mlp.gate_proj.weight has shape [128, 64], but config.json implies [96, 64]" in message


def test_missing_and_unexpected_tensors_are_named(qwen3_copy):
    single, _ = qwen3_copy
    edit_config(single, num_hidden_layers=3)
    assert "lacks tensor model.layers.2." in refusal(single)
    edit_config(single, num_hidden_layers=1)
    assert "holds tensor model.layers.1." in refusal(single)


def test_spare_tensors_transformers_ignores_are_ignored(qwen3_copy):
    """A tied checkpoint that still stores lm_head.weight (HF re-ties it and drops the copy), and the RoPE
    buffers old transformers versions saved: both skipped, as transformers skips them."""
    from safetensors.torch import load_file, save_file

    single, _ = qwen3_copy
    before = load_model(single).model.state_dict()
    weights = load_file(str(single / "model.safetensors"))
    extra = {"lm_head.weight": torch.randn(VOCAB, 64), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)}
    save_file(weights | extra, str(single / "model.safetensors"))
    after = load_model(single).model
    assert after.output.weight is after.tok_embeddings.weight
    assert all(torch.equal(after.state_dict()[k], before[k]) for k in before)


def test_bad_index_and_non_float_weights_are_refused(qwen3_copy):
    from safetensors.torch import load_file, save_file

    single, sharded = qwen3_copy
    index = json.loads((sharded / INDEX_FILE).read_text())
    first = next(iter(index["weight_map"]))
    (sharded / INDEX_FILE).write_text(
        json.dumps(index | {"weight_map": {**index["weight_map"], first: "../x.safetensors"}})
    )
    assert "lists '../x.safetensors', not a .safetensors file beside it" in refusal(sharded)
    (sharded / INDEX_FILE).write_text("{")
    assert "is not a safetensors index" in refusal(sharded)

    weights = load_file(str(single / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.int8)
    save_file(weights, str(single / "model.safetensors"))
    assert "tensor model.norm.weight is I8; phalanx reads float weights" in refusal(single)
    (single / "model.safetensors").write_bytes(b"not safetensors")
    assert "could not be read as safetensors" in refusal(single)


def test_pickle_weights_are_refused_unopened(qwen3_copy, tmp_path):
    """A pytorch_model.bin that would leave a marker file if it were ever unpickled."""
    single, _ = qwen3_copy
    (single / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"

    class Trap:
        def __reduce__(self):
            return Path.touch, (marker,)

    (single / "pytorch_model.bin").write_bytes(pickle.dumps(Trap()))
    assert is_hf_export(single)
    message = refusal(single)
    assert "pytorch_model.bin" in message and "never unpickles" in message and "save_pretrained" in message
    assert not marker.exists()


def test_the_cli_turns_a_refusal_into_exit_2_and_one_line(qwen3_copy, tmp_path):
    single, _ = qwen3_copy
    edit_config(single, hidden_act="gelu")
    result = phalanx("export", str(single), "--format", "hf", "--out", str(tmp_path / "out"), check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "hidden_act=gelu" in lines[0], result.stderr
