"""The exit-code table in phalanx/errors.py is the only one: the README shows it as it is, and every
error type's code is in it."""

from __future__ import annotations

import inspect
from pathlib import Path

import phalanx.errors as errors

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_shows_the_exit_code_table():
    assert errors.exit_code_table() in README.read_text(), (
        "README's exit-code table differs from phalanx/errors.py; paste errors.exit_code_table() into it"
    )


def test_every_error_type_has_a_row():
    rows = {e.code for e in errors.EXIT_CODES}
    types = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.PhalanxError)]
    assert len(types) >= 7
    for cls in types:
        if cls is errors.StoppedBySignal:
            assert "128 + N" in rows and errors.StoppedBySignal(15).exit_code == 143
        else:
            assert str(cls.exit_code) in rows, f"{cls.__name__} exits {cls.exit_code}, which has no row"
