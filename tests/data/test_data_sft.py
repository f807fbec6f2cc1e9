"""Fine-tuning records as masked examples (data/sft.py, data/prepare.py): the three record shapes from
JSONL and Parquet, detected or forced; only the assistant's replies trained (each followed by EOS with
phalanx's template, by the template's own end of turn with a checkpoint's); refusals in one line naming
file:line; too-long examples refused or truncated; whole examples in the val split; parallel shard streams
that never split an example; the cache key."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import phalanx.data.prepare as prepare_module
from phalanx.data.chat_template import CHAT_TEMPLATE, render_chat
from phalanx.data.corpus import resolve_sources, sources_fingerprint
from phalanx.data.prepare import FORMAT_VERSION, PreparedData, prepare_data
from phalanx.data.sft import ExampleWriter, SftExamples, SftOptions, chat_segments
from phalanx.data.tokenizer import BOS, EOS, load_tokenizer
from phalanx.errors import PhalanxError

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What light through yonder window breaks?"},
    {"role": "assistant", "content": "It is the east, and Juliet is the sun."},
    {"role": "tool", "content": '{"sunrise": "06:12"}'},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "  Arise, fair sun!\n"},  # phalanx's template trims it
]
ALPACA = [
    {"instruction": "Name a play.", "input": "", "output": "Hamlet."},
    {"instruction": "Translate to French.", "input": "good night", "output": "bonne nuit"},
]
PROMPTS = [{"prompt": "To be, or not to be:", "completion": " that is the question."}]
ONE_LINE = "^[^\n]*$"  # a refusal is one line, never a traceback


def write_records(path, records):
    """JSONL or Parquet (pyarrow, as a user's export from pandas or datasets would be), by suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prepare(tmp_path, sources=("data",), val_fraction=0.0, tokenizer=None, vocab_size=300, **options):
    sft = SftOptions(**{"max_tokens": 256, **options})
    return prepare_data(list(sources), tmp_path, tmp_path / "cache", vocab_size, tokenizer, val_fraction, sft=sft)


def examples(data, split="train"):
    return SftExamples(
        getattr(data, f"{split}_shards"), getattr(data, f"{split}_mask_shards"), getattr(data, f"{split}_length_shards")
    )


def decoded(data, split="train"):
    """[(the whole example's text, [the text of each run of trained tokens])] of a split."""
    tok = load_tokenizer(data.tokenizer_path)
    out = []
    for i in range(len(ex := examples(data, split))):
        ids, trained = ex.example(i)
        assert not trained[0]  # nothing in the example predicts its first token
        runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(trained.astype(int))) + 1)
        replies = [tok.decode(ids[r].tolist(), skip_special_tokens=False) for r in runs if trained[r[0]]]
        out.append((tok.decode(ids.tolist(), skip_special_tokens=False), replies))
    return out


def manifest(data):
    return json.loads((data.dir / "manifest.json").read_text())


# --- shapes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_conversation_trains_only_its_replies_each_ended_by_eos(tmp_path, suffix):
    write_records(tmp_path / "data" / f"chat{suffix}", [{"messages": CHAT, "id": 7}])  # other keys are ignored
    data = prepare(tmp_path)
    assert data.kind == "sft" and data.val_shards == [] and data.examples["train"] == 1
    ((text, replies),) = decoded(data)
    # The template's text, with EOS after each reply: the server stops on EOS (serve's CHAT_STOP aside).
    rendered = render_chat(CHAT, bos_token=BOS, add_generation_prompt=False, eos_token=EOS)
    assert text == rendered.replace("sun.\n\nTOOL", f"sun.{EOS}\n\nTOOL").replace("sun!\n\n", f"sun!{EOS}\n\n")
    assert text.startswith(BOS) and text.count(BOS) == 1  # the template's bos_token, not a second one
    assert replies == [f"It is the east, and Juliet is the sun.{EOS}", f"Arise, fair sun!{EOS}"]
    m = manifest(data)
    assert m["kind"] == "sft" and m["record_shapes"] == {
        str((tmp_path / "data" / f"chat{suffix}").resolve()): "messages"
    }
    assert m["chat_template_source"] == "phalanx"
    assert m["chat_template_sha256"] == hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()
    assert m["sft"] == {"shape": "auto", "train_on_prompts": False, "too_long": "refuse", "max_tokens": 256}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_alpaca_records_are_a_user_turn_and_a_reply(tmp_path, suffix):
    write_records(tmp_path / "data" / f"a{suffix}", ALPACA)
    first, second = decoded(prepare(tmp_path))
    assert first == (f"{BOS}USER:\nName a play.\n\nASSISTANT:\nHamlet.{EOS}\n\n", [f"Hamlet.{EOS}"])
    text = f"{BOS}USER:\nTranslate to French.\n\ngood night\n\nASSISTANT:\nbonne nuit{EOS}\n\n"
    assert second == (text, [f"bonne nuit{EOS}"])


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_prompt_completion_is_plain_text_with_the_completion_trained(tmp_path, suffix):
    write_records(tmp_path / "data" / f"p{suffix}", PROMPTS)
    ((text, replies),) = decoded(prepare(tmp_path))
    assert text == f"{BOS}To be, or not to be: that is the question.{EOS}"  # no chat template
    assert replies == [f" that is the question.{EOS}"]


def test_train_on_prompts_trains_all_but_the_first_token(tmp_path):
    write_records(tmp_path / "data" / "chat.jsonl", [{"messages": CHAT}])
    plain, everything = examples(prepare(tmp_path)), examples(prepare(tmp_path, train_on_prompts=True))
    (ids, trained), (all_ids, all_trained) = plain.example(0), everything.example(0)
    np.testing.assert_array_equal(ids, all_ids)  # the same tokens
    assert not all_trained[0] and all_trained[1:].all() and trained.sum() < all_trained.sum()


def test_each_file_gets_its_own_shape_or_the_one_forced(tmp_path):
    write_records(tmp_path / "data" / "a.jsonl", ALPACA)
    write_records(tmp_path / "data" / "b.jsonl", [{"messages": CHAT}])
    data = prepare(tmp_path)
    assert sorted(manifest(data)["record_shapes"].values()) == ["alpaca", "messages"]
    assert data.examples == {
        "records": 3,
        "train": 3,
        "val": 0,
        "train_trained_tokens": data.examples["train_trained_tokens"],
        "val_trained_tokens": 0,
        "truncated": 0,
        "dropped": 0,
    }
    # Records that fit two shapes: auto takes alpaca; forced, prompt/completion.
    both = [{"instruction": "I", "output": "O", "prompt": "P", "completion": " C"}]
    write_records(tmp_path / "both" / "x.jsonl", both)
    ((_, auto),) = decoded(prepare(tmp_path, sources=["both"]))
    forced_data = prepare(tmp_path, sources=["both"], shape="prompt_completion")
    ((_, forced),) = decoded(forced_data)
    assert (auto, forced) == ([f"O{EOS}"], [f" C{EOS}"])
    assert list(manifest(forced_data)["record_shapes"].values()) == ["prompt_completion"]
    with pytest.raises(PhalanxError, match=r"x\.jsonl:1: no 'messages' field \(this file's records are messages"):
        prepare(tmp_path, sources=["both"], shape="messages")
    with pytest.raises(PhalanxError, match="data.sft.shape must be auto or one of"):
        SftOptions(shape="chat", max_tokens=10)


# --- refusals ----------------------------------------------------------------------------------------

GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"messages": [', "invalid JSON"),
        ("[1, 2]", "a record must be a JSON object, not list"),
        ('{"text": "hi"}', "no 'messages' field (this file's records are messages"),
        ('{"messages": "hi"}', "'messages' must be a non-empty list of {role, content} objects"),
        ('{"messages": ["hi"]}', "message 1 is str, expected a {role, content} object"),
        ('{"messages": [{"role": "bot", "content": "hi"}]}', "message 1 has role 'bot'; expected one of system, user"),
        ('{"messages": [{"role": "user", "content": 3}]}', "message 1's content is int, expected a string"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message, so nothing to train on"),
    ],
)
def test_a_bad_record_is_refused_in_one_line_naming_its_line(tmp_path, line, message):
    path = tmp_path / "data" / "d.jsonl"
    path.parent.mkdir()
    path.write_text(f"{GOOD}\n\n{line}\n")  # the blank line still counts
    with pytest.raises(PhalanxError, match=ONE_LINE) as caught:
        prepare(tmp_path)
    assert str(caught.value).startswith(f"{path.resolve()}:3: {message}")
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-prepared left


@pytest.mark.parametrize(
    "records, message",
    [
        ([{"a": 1}], "row 1: cannot tell the record shape from its keys (a)"),
        ([{"instruction": "I", "output": 5}], "row 1: field 'output' is int, expected a string"),
        (  # Parquet gives every row every struct field: one a row lacks is null
            [{"messages": CHAT[1:3]}, {"messages": [{"role": "user"}, CHAT[2]]}],
            "row 2: message 1's content is NoneType, expected a string",
        ),
        ([*PROMPTS, {"prompt": "P", "completion": None}], "row 2: field 'completion' is NoneType, expected a string"),
    ],
)
def test_a_bad_parquet_row_is_refused_naming_its_row(tmp_path, records, message):
    path = write_records(tmp_path / "data" / "d.parquet", records)
    with pytest.raises(PhalanxError, match=ONE_LINE) as caught:
        prepare(tmp_path)
    assert str(caught.value).startswith(f"{path.resolve()}:{message}")


def test_unreadable_parquet_and_other_sources_are_refused(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "d.parquet").write_text("not parquet")
    with pytest.raises(PhalanxError, match=r"d\.parquet: not a readable Parquet file"):
        prepare(tmp_path)
    (tmp_path / "data" / "d.parquet").unlink()
    (tmp_path / "data" / "notes.txt").write_text("plain text")
    with pytest.raises(PhalanxError, match=r"holds no \.jsonl/\.jsonl\.gz/\.jsonl\.zst/\.parquet files"):
        prepare(tmp_path)
    with pytest.raises(
        PhalanxError, match=r"has unsupported type '\.txt'; use \.jsonl, \.jsonl\.gz, \.jsonl\.zst, \.parquet"
    ):
        prepare(tmp_path, sources=["data/notes.txt"])
    with pytest.raises(
        PhalanxError, match=r"is plain text; these sources are \.jsonl/\.jsonl\.gz/\.jsonl\.zst/\.parquet files"
    ):
        prepare(tmp_path, sources=["builtin:shakespeare"])


def test_a_template_that_renders_turns_inconsistently_is_refused():
    # Shows only the last assistant reply: earlier replies are not where the model is asked for them.
    template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    two_turns = [CHAT[1], CHAT[2], CHAT[4], CHAT[5]]
    with pytest.raises(ValueError, match=r"renders message 2 \(assistant\) inconsistently"):
        chat_segments(two_turns, template, {"bos_token": "", "eos_token": ""})
    one_turn = chat_segments(two_turns[:2], template, {"bos_token": "", "eos_token": ""})  # fine
    assert [text for text, trained in one_turn if trained] == [f"{CHAT[2]['content']}\n"]


# --- too long ----------------------------------------------------------------------------------------


SHORT = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Yo."}]


def test_too_long_examples_are_refused_or_truncated(tmp_path):
    long_reply = {"messages": [{"role": "user", "content": "Speak."}, {"role": "assistant", "content": "words " * 40}]}
    long_prompt = {"messages": [{"role": "user", "content": "words " * 40}, {"role": "assistant", "content": "Yes."}]}
    path = write_records(tmp_path / "data" / "d.jsonl", [{"messages": SHORT}] * 2 + [long_reply, long_prompt])
    with pytest.raises(PhalanxError, match=ONE_LINE) as caught:
        prepare(tmp_path, max_tokens=24)
    message = str(caught.value)
    assert message.startswith(f"{path.resolve()}:3: the example is ") and "tokens; train.seq_len + 1 = 24" in message
    assert "data.sft.too_long: truncate" in message

    data = prepare(tmp_path, max_tokens=24, too_long="truncate")
    ex = examples(data)
    assert ex.lengths.tolist()[2] == 24 and ex.lengths.max() == 24
    # The long prompt's reply lay past the cut: nothing left to train, so it was dropped.
    assert (data.examples["records"], data.examples["train"]) == (4, 3)
    assert (data.examples["truncated"], data.examples["dropped"]) == (1, 1)  # each example counted once
    assert manifest(data)["examples"] == data.examples


# --- val split ---------------------------------------------------------------------------------------


def test_val_takes_whole_examples_at_about_val_fraction(tmp_path):
    records = [{"prompt": f"Line {i}:", "completion": f" answer {i}"} for i in range(20)]
    write_records(tmp_path / "data" / "d.jsonl", records)
    data = prepare(tmp_path, val_fraction=0.2)
    val, train = decoded(data, "val"), decoded(data, "train")
    assert (len(train), len(val)) == (16, 4) == (data.examples["train"], data.examples["val"])
    assert [text for text, _ in val] == [f"{BOS}Line {i}: answer {i}{EOS}" for i in (1, 6, 11, 16)]
    assert data.val_tokens == sum(examples(data, "val").lengths)

    write_records(tmp_path / "two" / "d.jsonl", records[:2])  # at least one to val from two records
    assert prepare(tmp_path, sources=["two"], val_fraction=0.01).examples["val"] == 1
    write_records(tmp_path / "one" / "d.jsonl", records[:1])  # and never the only one
    assert prepare(tmp_path, sources=["one"], val_fraction=0.4).examples["train"] == 1


# --- shards ------------------------------------------------------------------------------------------


def test_examples_never_straddle_shards_and_read_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    lengths = [5, 3, 2, 6, 4, 10, 2, 7, 3]  # 10 fills a shard exactly; many do not fit the rest of one
    written = [(rng.integers(0, 50, n), rng.integers(0, 2, n).astype(bool)) for n in lengths]
    with ExampleWriter(tmp_path, "train", 50, max_length=10, max_tokens_per_shard=10) as w:
        for ids, trained in written:
            w.write(ids, trained)
    ex = SftExamples(w.tokens.paths, w.masks.paths, w.lengths.paths)
    assert len(w.tokens.paths) == len(w.masks.paths) == len(w.lengths.paths) == 5  # 5 3 2 | 6 4 | 10 | 2 7 | 3
    assert [p.name for p in w.masks.paths][:2] == ["train_mask_00000.bin", "train_mask_00001.bin"]
    assert ex.lengths.tolist() == lengths and len(ex) == 9
    for i, (ids, trained) in enumerate(written):
        got_ids, got_trained = ex.example(i)
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_trained, trained)
    with pytest.raises(IndexError):
        ex.example(9)


def test_mismatched_or_corrupt_streams_are_refused(tmp_path):
    with ExampleWriter(tmp_path, "train", 50, max_length=10, max_tokens_per_shard=10) as w:
        for n in (4, 4, 4):
            w.write(np.arange(n), np.ones(n, dtype=bool))
    tokens, masks, lengths = w.tokens.paths, w.masks.paths, w.lengths.paths
    with pytest.raises(PhalanxError, match="1 token, 2 mask and 2 length shards, which must pair up"):
        SftExamples(tokens[:1], masks, lengths)
    with pytest.raises(PhalanxError, match=r"train_00000\.bin, train_mask_00001\.bin and train_lengths_00000\.bin do"):
        SftExamples(tokens, masks[::-1], lengths)  # 8 tokens beside a shard of 4 flags
    with pytest.raises(PhalanxError, match="examples of 4 tokens; delete"):
        SftExamples(tokens, masks, lengths[::-1])
    raw = bytearray(tokens[0].read_bytes())
    raw[32] ^= 0xFF  # the first token's bytes: the chunk checksum catches it on first read
    tokens[0].write_bytes(bytes(raw))
    with pytest.raises(PhalanxError, match="corrupt token shard"):
        SftExamples(tokens, masks, lengths).example(0)


# --- cache -------------------------------------------------------------------------------------------


def test_the_cache_is_reused_and_keyed_by_every_option(tmp_path, monkeypatch):
    write_records(tmp_path / "data" / "d.jsonl", [{"messages": CHAT}, *[{"messages": CHAT[1:3]}] * 3])
    first = prepare(tmp_path, val_fraction=0.3)
    assert first == PreparedData.load(first.dir) and first.val_shards and first.val_mask_shards

    def fail(*args, **kwargs):
        raise AssertionError("re-encoded cached examples")

    with monkeypatch.context() as m:
        m.setattr(prepare_module, "iter_examples", fail)
        m.setattr(prepare_module, "train_tokenizer", fail)
        assert prepare(tmp_path, val_fraction=0.3) == first
    others = [
        prepare(tmp_path, val_fraction=0.3, max_tokens=255),  # another train.seq_len
        prepare(tmp_path, val_fraction=0.3, train_on_prompts=True),
        prepare(tmp_path, val_fraction=0.3, too_long="truncate"),
        prepare(tmp_path, val_fraction=0.3, shape="messages"),
    ]
    assert len({first.dir, *(o.dir for o in others)}) == 5
    # Text keeps the key (and so the caches) it had before fine-tuning existed.
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("the king and queen of verona " * 20)
    text = prepare_data(["text"], tmp_path, tmp_path / "cache", 300, None, 0.1)
    resolved = resolve_sources(["text"], tmp_path)
    old_key = json.dumps([FORMAT_VERSION, sources_fingerprint(resolved), 300, None, 0.1, "text"])
    assert text.dir.name == hashlib.sha256(old_key.encode()).hexdigest()[:20]
    assert (text.kind, text.train_mask_shards, text.examples) == ("text", [], {})
    assert manifest(text)["kind"] == "text"


def test_a_manifest_from_before_kinds_reads_as_text(tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("the king and queen of verona " * 20)
    data = prepare_data(["text"], tmp_path, tmp_path / "cache", 300, None, 0.1)
    m = manifest(data)
    del m["kind"]
    (data.dir / "manifest.json").write_text(json.dumps(m))
    assert PreparedData.load(data.dir) == data
    m["kind"] = "images"
    (data.dir / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PhalanxError, match="unknown kind 'images'"):
        PreparedData.load(data.dir)


# --- a checkpoint's tokenizer and chat template --------------------------------------------------------

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# Qwen's shape: a default system prompt, ChatML turns; and a refusal of its own, by raise_exception.
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('tool messages need tool calls') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def qwen_tokenizer(tmp_path):
    """A small byte-level BPE tokenizer.json with ChatML specials, no BOS, EOS <|im_end|> and the template
    in tokenizer_config.json, as a checkpoint has them."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([m["content"] for m in CHAT] * 5, trainer=trainer)
    directory = tmp_path / "qwen"
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": IM_END, "chat_template": QWEN_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


def test_a_checkpoints_template_renders_as_transformers_does_and_ends_turns_its_way(tmp_path, qwen_tokenizer):
    transformers = pytest.importorskip("transformers")
    conversation = [m for m in CHAT if m["role"] not in ("system", "tool")]
    write_records(tmp_path / "data" / "a.jsonl", ALPACA)
    write_records(tmp_path / "data" / "b.jsonl", [{"messages": conversation}])
    data = prepare(tmp_path, tokenizer=str(qwen_tokenizer), vocab_size=512)
    assert (data.dir / "tokenizer_config.json").is_file()  # the companions travel with it
    assert manifest(data)["chat_template_source"] == "tokenizer"
    assert manifest(data)["chat_template_sha256"] == hashlib.sha256(QWEN_TEMPLATE.encode()).hexdigest()

    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(qwen_tokenizer), eos_token=IM_END)
    *_, (text, replies) = decoded(data)
    assert text == reference.apply_chat_template(conversation, chat_template=QWEN_TEMPLATE, tokenize=False)
    assert text.startswith(f"{IM_START}system\nYou are a helpful assistant.")  # no BOS: Qwen has none
    # The template's own end of turn is trained (and the newline it writes after it); no EOS is added.
    assert replies == [f"It is the east, and Juliet is the sun.{IM_END}\n", f"  Arise, fair sun!\n{IM_END}\n"]

    write_records(tmp_path / "tool" / "d.jsonl", [{"messages": CHAT}])
    with pytest.raises(PhalanxError, match=ONE_LINE) as caught:
        prepare(tmp_path, sources=["tool"], tokenizer=str(qwen_tokenizer), vocab_size=512)
    message = (
        f"{(tmp_path / 'tool' / 'd.jsonl').resolve()}:1: the chat template refused it: tool messages need tool calls"
    )
    assert str(caught.value) == message


def test_the_builtin_dialogue_pairs_each_speech_with_the_next_speakers_reply_within_a_scene():
    from phalanx.data.sft import BUILTIN_DIALOGUE, DIALOGUE_MAX_CHARS, iter_records, play_dialogue, resolve_sft_sources

    play = (
        "# A Play\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter A and B_\n\n**ALPHA**  \nGood morrow.\n\n"
        "**BETA**  \nGood morrow, friend.\n\n_Exit ALPHA_\n\nAnd farewell.\n\n**ALPHA**  \nStay!\n\n"
        "### SCENE II. A field.\n\n**GAMMA**  \nWho goes there?\n\n**GAMMA**  \nSpeak!\n\n**DELTA**  \n"
        + "Ay. " * 100
        + "\n"
    )
    # Beta's speech keeps its line after the stage direction; no pair crosses the scene; Gamma speaking
    # twice is no exchange; Delta's reply is too long.
    assert list(play_dialogue(play)) == [
        ("Good morrow.", "Good morrow, friend.\nAnd farewell."),
        ("Good morrow, friend.\nAnd farewell.", "Stay!"),
    ]
    sources = resolve_sft_sources([BUILTIN_DIALOGUE], Path.cwd())
    assert len(sources) == 38 and {s.kind for s in sources} == {"dialogue"}
    records = list(iter_records(sources[:1]))
    assert records and all(len(m["content"]) <= DIALOGUE_MAX_CHARS for r in records for m in r.messages)
