"""Corpus sources: resolution, reading, conversion of the builtin plays, fingerprints."""

import json
import os
from pathlib import Path

import pytest

from phalanx.data.corpus import (
    BUILTIN_SHAKESPEARE,
    Source,
    iter_documents,
    play_to_text,
    resolve_sources,
    sources_fingerprint,
)
from phalanx.errors import PhalanxError


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def names(sources):
    return [s.path.name for s in sources]


def test_resolves_file_dir_and_glob_relative_to_base_dir_sorted_and_deduplicated(tmp_path):
    write(tmp_path / "data" / "b.txt", "b")
    write(tmp_path / "data" / "a.md", "a")
    write(tmp_path / "data" / "deep" / "c.jsonl", '{"text": "c"}\n')
    write(tmp_path / "data" / "notes.csv", "ignored inside a directory")
    write(tmp_path / "data" / ".ipynb_checkpoints" / "b-checkpoint.txt", "hidden: ignored")
    write(tmp_path / "single.txt", "s")

    assert names(resolve_sources(["single.txt"], tmp_path)) == ["single.txt"]
    assert names(resolve_sources(["data"], tmp_path)) == ["a.md", "b.txt", "c.jsonl"]
    assert names(resolve_sources(["data/*.txt"], tmp_path)) == ["b.txt"]
    assert names(resolve_sources(["data/**/*.jsonl"], tmp_path)) == ["c.jsonl"]
    # the same file reached three ways appears once; order follows the path, not the list
    both = resolve_sources(["single.txt", "data/b.txt", "data", "data/*.txt", str(tmp_path / "single.txt")], tmp_path)
    assert [s.path for s in both] == sorted({s.path for s in both})
    assert names(both) == ["a.md", "b.txt", "c.jsonl", "single.txt"]
    kinds = {s.path.name: s.kind for s in both}
    assert kinds == {"a.md": "text", "b.txt": "text", "c.jsonl": "jsonl", "single.txt": "text"}


@pytest.mark.parametrize(
    "entry, message",
    [
        ("missing.txt", "not found"),
        ("nothing/*.txt", "matched no files"),
        ("table.csv", "unsupported type '.csv'"),
        ("*.csv", "unsupported type '.csv'"),
        ("empty_dir", "holds no"),
        ("builtin:poems", "unknown builtin"),
    ],
)
def test_bad_sources_raise_one_line_errors(tmp_path, entry, message):
    write(tmp_path / "table.csv", "a,b")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(PhalanxError, match=message) as e:
        resolve_sources([entry], tmp_path)
    assert "\n" not in str(e.value)


def test_builtin_shakespeare_resolves_to_plain_play_text():
    sources = resolve_sources([BUILTIN_SHAKESPEARE], Path("/nonexistent"))
    assert len(sources) == 38 and all(s.kind == "play" for s in sources)
    romeo = [s for s in sources if s.path.name == "romeo-and-juliet.md"]
    (text,) = list(iter_documents(romeo))
    assert "\nROMEO:\n" in text
    assert text.startswith("Romeo and Juliet\n")
    for markup in ("**", "_Enter", "# ", "  \n", "\\["):
        assert markup not in text


def test_play_to_text_layout():
    markdown = (
        "# A Play\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter ROMEO and\nJULIET_\n\n"
        "**ROMEO**  \nBut soft, what light  \nthrough yonder window breaks?\n\n"
        "**JULIET**  \n__\\[Aside]_  \nAy me.\n"
    )
    assert play_to_text(markdown) == (
        "A Play\n\nACT I\n\nSCENE I. A room.\n\nEnter ROMEO and\nJULIET\n\n"
        "ROMEO:\nBut soft, what light\nthrough yonder window breaks?\n\n"
        "JULIET:\n[Aside]\nAy me.\n"
    )


def test_jsonl_documents_default_and_custom_field(tmp_path):
    write(tmp_path / "a.jsonl", '{"text": "one"}\n\n{"text": ""}\n{"text": "two", "body": "x"}\n')
    write(tmp_path / "b.jsonl", '{"body": "three"}\n')
    assert list(iter_documents(resolve_sources(["a.jsonl"], tmp_path))) == ["one", "two"]
    assert list(iter_documents(resolve_sources(["b.jsonl"], tmp_path), text_field="body")) == ["three"]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "ok"}\n{"text": broken}\n', r"bad\.jsonl:2: invalid JSON"),
        ('{"text": "ok"}\n{"other": "x"}\n', r"bad\.jsonl:2: no 'text' field"),
        ('{"text": "ok"}\n\n["text"]\n', r"bad\.jsonl:3: no 'text' field"),
        ('{"text": 5}\n', r"bad\.jsonl:1: field 'text' is int"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, content, message):
    write(tmp_path / "bad.jsonl", content)
    with pytest.raises(PhalanxError, match=message):
        list(iter_documents(resolve_sources(["bad.jsonl"], tmp_path)))


def test_invalid_utf8_names_the_file(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(PhalanxError, match=r"latin1\.txt is not valid UTF-8"):
        list(iter_documents(resolve_sources(["latin1.txt"], tmp_path)))
    with pytest.raises(PhalanxError, match=r"latin1\.jsonl:2: not valid UTF-8"):
        list(iter_documents(resolve_sources(["latin1.jsonl"], tmp_path)))


def test_empty_documents_are_skipped_and_an_empty_corpus_is_an_error(tmp_path):
    write(tmp_path / "a.txt", "")
    write(tmp_path / "b.txt", "  \n")
    write(tmp_path / "c.jsonl", '{"text": ""}\n')
    sources = resolve_sources(["*"], tmp_path)
    with pytest.raises(PhalanxError, match="corpus is empty"):
        list(iter_documents(sources))
    write(tmp_path / "d.txt", "words")
    assert list(iter_documents(resolve_sources(["*"], tmp_path))) == ["words"]


def test_fingerprint_is_stable_and_changes_when_a_file_changes(tmp_path):
    path = write(tmp_path / "a.txt", "hello")
    sources = [Source(path, "text")]
    first = sources_fingerprint(sources)
    assert sources_fingerprint(sources) == first
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert sources_fingerprint(sources) != first
    more = sources + [Source(write(tmp_path / "b.txt", "x"), "text")]
    assert sources_fingerprint(more) != sources_fingerprint(sources)
    json.dumps(first)  # a plain string, usable in a JSON manifest
