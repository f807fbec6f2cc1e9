"""Token ids in, text out, a piece at a time: never half a character, never a piece of a stop string.

A byte-level BPE token can hold part of a UTF-8 character, so decoding a lone token may give U+FFFD.
IncrementalText decodes a short window of recent tokens twice (without and with the new ones) and hands
out the difference only once it no longer ends in U+FFFD. The window starts where the last piece ended,
so whatever a decoder does at the start of a text (dropping a leading space) is the same in both decodes.
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
# A character is at most 4 bytes: past this many held tokens the U+FFFD is real (invalid bytes), not pending.
MAX_HELD_TOKENS = 4


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window's first token
        self.done = 0  # tokens whose text has been handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """The new complete text after `token` ('' while a character is still incomplete)."""
        self.ids.append(token)
        before = self._decode(self.ids[self.start : self.done])
        after = self._decode(self.ids[self.start :])
        if after.endswith(REPLACEMENT) and len(self.ids) - self.done < MAX_HELD_TOKENS:
            return ""
        return self._advance(before, after)

    def flush(self) -> str:
        """Whatever is still held (at the end of generation), invalid bytes shown as U+FFFD."""
        if self.done == len(self.ids):
            return ""
        return self._advance(self._decode(self.ids[self.start : self.done]), self._decode(self.ids[self.start :]))

    def _advance(self, before: str, after: str) -> str:
        self.start, self.done = self.done, len(self.ids)
        return after[len(before) :]


class StopMatcher:
    """Passes text through until one of the stop strings appears; holds back any tail that could still
    become one, so no piece of a stop string is ever handed out."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(stops)
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        text = self.held + text
        if not self.stops:
            self.held = ""
            return text
        hits = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)]
        keep = self._partial_stop_length(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        text, self.held = self.held, ""
        return "" if self.stopped else text

    def _partial_stop_length(self, text: str) -> int:
        """The length of the longest tail of `text` that is the start of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[-n:]):
                    best = n
                    break
        return best
