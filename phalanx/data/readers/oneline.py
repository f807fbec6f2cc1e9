"""The first line of a library's error message: what a one-line refusal quotes of it."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
