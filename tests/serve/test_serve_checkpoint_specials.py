"""A checkpoint's own special tokens and chat template, not phalanx's names: a small random Qwen3
checkpoint made by transformers (ChatML template, no BOS, EOS <|endoftext|>, generation_config stopping at
<|im_end|> too) loads, is served with its template as transformers renders it, stops at <|im_end|>, and
exports with its specials; a Llama-3-style one still gets BOS; a run started from the Qwen one frames
its data without BOS and is served and exported with the checkpoint's template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phalanx.data.tokenizer import BOS, special_tokens, train_tokenizer
from phalanx.export.gguf_export import write_gguf
from phalanx.export.hf import write_hf_export
from phalanx.run.model_loader import load_model
from phalanx.serve.core.options import DEFAULTS, SamplingOptions
from phalanx.serve.core.served import load_served_model
from phalanx.serve.engines.torch_engine import Engine
from tests.data.test_data_specials import CHATML, ENDOFTEXT, IM_END, IM_START, chatml_tokenizer
from tests.helpers import train_json
from tests.hf_checkpoints import TINY_SHAPE, make_llama_checkpoint

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "But soft, what light?"},
    {"role": "assistant", "content": "It is the east."},
    {"role": "user", "content": "And Juliet?"},
]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def make_qwen_checkpoint(out: Path, documents: list[str], stop_at_once: bool = False) -> Path:
    """A random Qwen3ForCausalLM over a ChatML tokenizer without BOS. stop_at_once: weights under which
    <|im_end|> is every position's argmax (a constant residual dimension the head reads it from)."""
    import transformers

    tokenizer = chatml_tokenizer(documents, vocab_size=320)
    eos, im_end = tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END)
    config = transformers.Qwen3Config(
        **TINY_SHAPE,
        head_dim=16,
        vocab_size=tokenizer.get_vocab_size(),
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    if stop_at_once:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 50.0
            for layer in model.model.layers:  # nothing writes into dimension 0 of the residual
                layer.self_attn.o_proj.weight[0] = 0.0
                layer.mlp.down_proj.weight[0] = 0.0
            model.lm_head.weight[im_end, 0] = 5.0
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": ENDOFTEXT,
        "add_bos_token": False,
        "chat_template": CHATML,
        "model_max_length": 64,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eos]}))
    return out


@pytest.fixture(scope="module")
def documents(corpus) -> list[str]:
    return [corpus.read_text()[:200_000]]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, documents) -> Path:
    return make_qwen_checkpoint(tmp_path_factory.mktemp("qwen3"), documents)


def hf_chat_ids(directory: Path, messages: list[dict]) -> tuple[str, list[int]]:
    """The prompt transformers renders for `messages` from `directory`'s tokenizer files, and its ids."""
    import transformers

    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, hf(text, add_special_tokens=False)["input_ids"]


def test_a_qwen_checkpoint_is_served_with_its_own_specials_and_template(qwen):
    served = load_served_model(qwen)  # no "lacks the special token(s)" refusal
    tokenizer, specials = served.loaded.tokenizer, served.loaded.specials
    eos, im_end = tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END)
    assert (specials.bos_id, specials.eos_id, specials.end_of_turn_id) == (None, eos, im_end)
    assert set(specials.stop_ids) == {eos, im_end}
    assert served.loaded.chat_template == CHATML and served.chat_stops == []
    text, expected = hf_chat_ids(qwen, MESSAGES)
    ids = served.chat_prompt_ids(MESSAGES)
    assert ids == expected and tokenizer.decode(ids, skip_special_tokens=False) == text
    assert ids[0] == tokenizer.token_to_id(IM_START) and ids.count(im_end) == len(MESSAGES)
    assert served.text_prompt_ids("It is the east") == tokenizer.encode("It is the east").ids  # no BOS
    assert served.details()["family"] == "qwen3" and served.details()["families"] == ["qwen3"]


def test_generation_stops_at_the_end_of_turn_not_only_at_eos(tmp_path, documents):
    served = load_served_model(make_qwen_checkpoint(tmp_path, documents, stop_at_once=True))
    prompt = served.chat_prompt_ids(MESSAGES[:2])
    engine = Engine(served.loaded.model, served.loaded.tokenizer, slots=1)
    engine.start()
    try:
        options = {**DEFAULTS, "temperature": 0.0, "max_tokens": 6}
        stopped = engine.submit(prompt, SamplingOptions(**options))
        assert "".join(stopped) == "" and stopped.finish.reason == "stop"
        assert stopped.finish.completion_tokens == 1  # <|im_end|>, which is not the EOS
        # The same request told to ignore stop tokens runs on to its limit: <|im_end|> is what stopped it.
        going = engine.submit(prompt, SamplingOptions(**options, ignore_eos=True))
        assert "".join(going) == "" and (going.finish.reason, going.finish.completion_tokens) == ("length", 6)
    finally:
        engine.stop()


def test_a_llama3_style_checkpoint_still_gets_bos(tmp_path, documents):
    tokenizer = train_tokenizer(documents, 384)
    tokenizer.add_special_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    checkpoint = make_llama_checkpoint(tmp_path / "llama", tmp_path / "tokenizer.json")
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA3_TEMPLATE}))
    eot = tokenizer.token_to_id("<|eot_id|>")
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, eot]}))
    served = load_served_model(checkpoint)
    specials = served.loaded.specials
    assert (specials.bos, specials.bos_id, specials.end_of_turn_id, set(specials.stop_ids)) == (BOS, 0, eot, {1, eot})
    assert served.text_prompt_ids("soft")[0] == 0
    ids = served.chat_prompt_ids(MESSAGES)
    assert ids[0] == 0 and ids.count(0) == 1 and ids.count(eot) == len(MESSAGES)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_chat_ids(checkpoint, MESSAGES)[0]


def test_exports_keep_the_checkpoints_specials_and_template(qwen, tmp_path):
    import gguf
    import transformers

    loaded = load_model(qwen)
    eos, im_end = loaded.tokenizer.token_to_id(ENDOFTEXT), loaded.tokenizer.token_to_id(IM_END)
    out = tmp_path / "hf"
    out.mkdir()
    write_hf_export(loaded, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == (None, ENDOFTEXT, False)
    assert config["chat_template"] == CHATML
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [eos, im_end]
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    assert hf("It is the east")["input_ids"] == loaded.tokenizer.encode("It is the east").ids  # no BOS added
    assert hf_chat_ids(out, MESSAGES) == hf_chat_ids(qwen, MESSAGES)
    again = load_model(out)
    assert special_tokens(again.tokenizer) == loaded.specials and again.chat_template == CHATML

    write_gguf(loaded, tmp_path / "model.gguf", "qwen")
    fields = gguf.GGUFReader(str(tmp_path / "model.gguf")).fields

    def value(key):
        return fields[key].contents() if key in fields else None

    assert value("tokenizer.ggml.bos_token_id") is None and value("tokenizer.ggml.add_bos_token") is False
    assert (value("tokenizer.ggml.eos_token_id"), value("tokenizer.ggml.eot_token_id")) == (eos, im_end)
    assert value("tokenizer.chat_template") == CHATML
    back = load_model(tmp_path / "model.gguf")  # read back: the file's own ids, no BOS
    assert (back.specials.bos_id, back.specials.eos_id, back.specials.end_of_turn_id) == (None, eos, im_end)
    assert back.chat_template == CHATML


def test_a_run_from_the_checkpoint_frames_without_bos_and_serves_with_its_template(qwen, tiny_args, corpus, tmp_path):
    from phalanx.data.corpus import iter_documents, resolve_sources
    from phalanx.data.shards import read_shard
    from phalanx.run.prepare import prepared_data

    fixed = ("model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.ffn_dim", "data.vocab_size")
    args = [a for a in tiny_args if not a.startswith(fixed)] + [f"model.pretrained={qwen}"]
    run_dir = Path(train_json(*args, "train.max_steps=2", "checkpoint.interval=2")["run_dir"])
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert (run_dir / name).read_bytes() == (qwen / name).read_bytes()

    data = prepared_data(run_dir)
    tokens = read_shard(data.train_shards[0]).tolist()
    served = load_served_model(run_dir)
    tokenizer = served.loaded.tokenizer
    eos = tokenizer.token_to_id(ENDOFTEXT)
    first = next(iter_documents(resolve_sources([str(corpus)], Path.cwd())))
    head = tokenizer.encode(first[:200]).ids[:-1]  # the last may merge on with what follows
    assert tokens[: len(head)] == head  # the document's text from the very first token: no BOS
    # Each document's tail goes to val: the corpus's last token there is the EOS that ends it.
    assert read_shard(data.val_shards[-1])[-1] == eos and tokenizer.token_to_id(BOS) is None

    assert served.loaded.chat_template == CHATML and served.loaded.specials.bos_id is None
    assert served.chat_prompt_ids(MESSAGES) == hf_chat_ids(qwen, MESSAGES)[1]
    out = tmp_path / "export"
    out.mkdir()
    write_hf_export(served.loaded, out)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML
