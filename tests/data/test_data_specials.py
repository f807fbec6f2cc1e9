"""The one owner of a tokenizer's special tokens (data/tokenizer.py): phalanx's own names for a tokenizer
phalanx trained; a checkpoint's from the files beside its tokenizer.json (tokenizer_config.json,
special_tokens_map.json, generation_config.json, the chat template), BOS optional; documents framed with
BOS only where there is one; bad files refused in one line."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from phalanx.data.tokenizer import (
    BOS,
    EOS,
    TOKENIZER_COMPANIONS,
    encode_documents,
    load_tokenizer,
    special_tokens,
    train_tokenizer,
)
from phalanx.errors import PhalanxError
from phalanx.run.layout import TOKENIZER_COMPANIONS as RUN_COMPANIONS

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["But soft, what light through yonder window breaks? " * 20, "It is the east, and Juliet is the sun. " * 20]


def chatml_tokenizer(documents: list[str], vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE tokenizer with Qwen's special tokens and no BOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


@pytest.fixture
def qwen_dir(tmp_path):
    """A tokenizer.json with Qwen-style companions: no BOS, EOS <|endoftext|>, <|im_end|> ends a turn."""
    tokenizer = chatml_tokenizer(TEXTS)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": {"content": ENDOFTEXT, "special": True}, "chat_template": CHATML}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ids = [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return tmp_path


def test_a_checkpoints_tokenizer_has_its_own_specials_and_no_bos(qwen_dir):
    tokenizer = load_tokenizer(qwen_dir / "tokenizer.json")  # no "lacks the special token" refusal
    specials = special_tokens(tokenizer)
    eos, im_end = tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END)
    assert (specials.bos, specials.bos_id, specials.eos, specials.eos_id) == (None, None, ENDOFTEXT, eos)
    assert (specials.end_of_turn, specials.end_of_turn_id) == (IM_END, im_end)
    assert specials.stop_ids == (eos, im_end)  # EOS first, each once
    assert specials.template_strings() == {"bos_token": "", "eos_token": ENDOFTEXT}

    (framed,) = encode_documents(tokenizer, [TEXTS[0]])
    plain = tokenizer.encode(TEXTS[0], add_special_tokens=False).ids
    assert framed.tolist() == plain + [eos]  # ids + [EOS], no BOS


def test_phalanx_trained_tokenizers_keep_phalanxs_names_and_framing(tmp_path):
    tokenizer = train_tokenizer(TEXTS, 300)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    specials = special_tokens(loaded)
    assert (specials.bos, specials.bos_id, specials.eos, specials.eos_id, specials.stop_ids) == (BOS, 0, EOS, 1, (1,))
    (framed,) = encode_documents(loaded, [TEXTS[1]])
    assert framed.tolist() == [0] + loaded.encode(TEXTS[1], add_special_tokens=False).ids + [1]


def test_a_mistral_style_config_and_add_bos_false(tmp_path):
    tokenizer = chatml_tokenizer(TEXTS)
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    specials = special_tokens(load_tokenizer(tmp_path / "tokenizer.json"))
    assert (specials.bos, specials.bos_id, specials.eos) == ("<s>", tokenizer.token_to_id("<s>"), "</s>")
    # A BOS the model was never given texts with: templates still see it, texts are not framed with it.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": False}))
    specials = special_tokens(load_tokenizer(tmp_path / "tokenizer.json"))
    assert (specials.bos, specials.bos_id, specials.eos) == ("<s>", None, "</s>")


@pytest.mark.parametrize(
    "file, content, message",
    [
        ("tokenizer_config.json", {"eos_token": "<|nope|>"}, "names eos_token '<|nope|>', which its tokenizer"),
        ("tokenizer_config.json", {"eos_token": 7}, "eos_token must be a token string"),
        ("tokenizer_config.json", {"bos_token": None}, "names no eos_token"),
        ("generation_config.json", {"eos_token_id": "x"}, "eos_token_id must be a token id or a list"),
        ("generation_config.json", {"eos_token_id": [99999]}, "stop id 99999 is not a token of its vocabulary"),
        ("tokenizer_config.json", "{not json", "is not valid JSON"),
    ],
)
def test_bad_special_token_files_are_refused_in_one_line(qwen_dir, file, content, message):
    (qwen_dir / file).write_text(content if isinstance(content, str) else json.dumps(content))
    if file == "tokenizer_config.json" and isinstance(content, dict) and "eos_token" not in content:
        (qwen_dir / "generation_config.json").unlink()
    with pytest.raises(PhalanxError, match="^[^\n]*$") as caught:
        load_tokenizer(qwen_dir / "tokenizer.json")
    assert message in str(caught.value)


def test_a_bare_tokenizer_without_phalanxs_names_is_still_refused(tmp_path):
    chatml_tokenizer(TEXTS).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(PhalanxError, match="lacks the special token"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_the_run_keeps_the_companions_under_the_names_the_loader_reads():
    assert RUN_COMPANIONS == TOKENIZER_COMPANIONS
