"""The documents a tokenizer is trained on: the whole corpus where it is small, a bounded sample of it
where it is large (data.tokenizer_sample_bytes), so that training the tokenizer costs the same on 5 GB as
on 500 GB and never holds more than the sample.

A corpus whose files hold no more than the bound together is read whole, in order, exactly as before the
bound existed (so its tokenizer, and its cached data, stay the same). A larger one gives each source a
share of the bound in proportion to its size on disk and takes that many bytes of text from its start:
every source is represented, and no file is read past its share. A hub dataset, whose size is unknown,
counts as the size of the whole bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from phalanx.data.corpus import Source, _read, iter_documents
from phalanx.data.units import _disk_size
from phalanx.errors import PhalanxError

DEFAULT_SAMPLE_BYTES = 1 << 30


def sample_documents(sources: list[Source], text_field: str, limit: int) -> Iterator[str]:
    sizes = [limit if s.kind == "hf_hub" else _disk_size(s) for s in sources]
    if sum(sizes) <= limit:  # compressed files may still hold more text than that: capped all the same
        yield from capped(iter_documents(sources, text_field), limit)
        return
    total = sum(sizes)
    taken_any = False
    for source, size in zip(sources, sizes):
        for doc in capped((d for d in _read(source, text_field) if d.strip()), limit * size // total):
            taken_any = True
            yield doc
    if not taken_any:
        raise PhalanxError(f"corpus is empty: no text in the sampled start of {len(sources)} source file(s)")


def capped(documents: Iterable[str], limit: int) -> Iterator[str]:
    """The documents until `limit` bytes of UTF-8 are taken, the last one cut to fit; then no more is read."""
    left = limit
    if left <= 0:
        return
    for doc in documents:
        size = len(doc) if doc.isascii() else len(doc.encode("utf-8"))
        if size > left:
            doc = doc.encode("utf-8")[:left].decode("utf-8", errors="ignore")  # a character cut in two is dropped
        left -= size
        if doc:
            yield doc
        if left <= 0:
            return
