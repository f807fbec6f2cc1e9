"""Prompts to token ids where only the chat template's own markers become control tokens.

A tokenizer matches its special tokens anywhere in the text it is given, so `"x<|end_of_text|>"` typed by
a user would become the end-of-text token (and, with a template whose role markers are special tokens,
a user could close their own turn and open the assistant's). Here what a user wrote is always encoded
as text: a second copy of the tokenizer with special-token matching off encodes it, and a special token
counts as a control token only where the template itself put it.

How the template's text is told from the user's: each message's content is rendered wrapped in two
Unicode noncharacters (never meaningful text), the wrapped rendering is split at them, and the pieces are
checked to join up to exactly what the template renders unwrapped. Only then are the special-token
strings found in the template's own pieces kept as control tokens; the text between them is encoded
with matching off, the same split the tokenizer itself makes at special tokens, so a prompt whose user
text holds no special-token string gets the same ids as a plain encode of the rendering.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer

OPEN, CLOSE = "\ufdd0", "\ufdd1"  # noncharacters: Unicode reserves them for a program's internal use


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._as_text = Tokenizer.from_str(tokenizer.to_str())
        self._as_text.encode_special_tokens = True  # special-token strings are tokenized like any text
        self.special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        longest_first = sorted(self.special, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None

    def text_ids(self, text: str) -> list[int]:
        """Text a user wrote: every character as text, special-token strings included."""
        return _ids(self._as_text, text) if text else []

    def chat_ids(self, messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str]) -> list[int]:
        """The conversation rendered by `render` (the chat template); special tokens only where the
        template wrote them. Raises ValueError where the template mangles the content so that the user's
        text cannot be told from its own and that text holds a special-token string."""
        # Only contents are wrapped; a special-token string in any other field (a name, a tool call's
        # arguments) is refused rather than risk it becoming a control token.
        self._refuse_special(
            _strings([{k: v for k, v in m.items() if k not in ("role", "content")} for m in messages]),
            "a message field",
        )
        plain = render(messages)
        contents = _strings([m.get("content") for m in messages])
        wrappable = not any(OPEN in s or CLOSE in s for s in contents)
        pieces = self._split(render([_wrapped(m) for m in messages]), plain) if wrappable else None
        if pieces is None:
            # The template's own text and the user's cannot be told apart: safe only if no content holds
            # a special-token string and the rendering holds the same special tokens as with every
            # content blank (a template that rewrites content could otherwise make one out of text).
            self._refuse_special(contents, "a message")
            blank = render([{**m, "content": ""} if isinstance(m.get("content"), str) else m for m in messages])
            if self._specials_in(plain) != self._specials_in(blank):
                raise ValueError(
                    "this chat template turns message text into special tokens; the messages "
                    "hold a special-token string once it has rendered them: change the text"
                )
            return _ids(self.tokenizer, plain)
        # Between the template's own special tokens everything is encoded as text.
        ids: list[int] = []
        run = ""
        for is_user, piece in pieces:
            if is_user or self._special_re is None:
                run += piece
                continue
            at = 0
            for match in self._special_re.finditer(piece):
                run += piece[at : match.start()]
                ids += self.text_ids(run)
                ids.append(self.special[match.group()])
                run, at = "", match.end()
            run += piece[at:]
        return ids + self.text_ids(run)

    def _specials_in(self, text: str) -> Counter:
        return Counter(m.group() for m in self._special_re.finditer(text)) if self._special_re else Counter()

    def _refuse_special(self, strings: list[str], where: str) -> None:
        for text in strings:
            match = self._special_re.search(text) if self._special_re is not None else None
            if match:
                raise ValueError(
                    f"{where} holds the special-token string {match.group()!r}, which this chat "
                    "template cannot keep apart from its own markers; remove it"
                )

    @staticmethod
    def _split(wrapped: str, plain: str) -> list[tuple[bool, str]] | None:
        """[(is_user_text, piece)], or None if the markers do not nest as wrapped or the pieces do not
        join up to `plain` (a template that changed the content in a way the markers did not survive)."""
        pieces: list[tuple[bool, str]] = []
        inside = False
        for part in re.split(f"([{OPEN}{CLOSE}])", wrapped):
            if part == OPEN:
                if inside:
                    return None
                inside = True
            elif part == CLOSE:
                if not inside:
                    return None
                inside = False
            elif part:
                pieces.append((inside, part))
        if inside or "".join(p for _, p in pieces) != plain:
            return None
        return pieces


def _wrapped(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, str) or not content.strip():
        return message
    # Whitespace stays outside the markers so a template that trims the content still trims it.
    core = content.strip()
    start = content.index(core)
    return {**message, "content": content[:start] + OPEN + core + CLOSE + content[start + len(core) :]}


def _strings(values: list[Any]) -> list[str]:
    """Every string in `values`, however nested in lists and dicts."""
    found: list[str] = []
    stack: list[Any] = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return found


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text`'s ids. Through encode_batch, which lets other threads run while it works: encode holds
    Python's lock throughout (a 1 MB prompt, 1.1 s, held the server's event loop for 1.3 s)."""
    return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
