"""Part files: the tokens of one work unit (data/units.py), kept in a staging directory until the shards
are written, so that an interrupted preparation picks up where it stopped.

A unit's part is three files, `part-NNNNNN.bin` (its documents' tokens, end to end, in the shards' token
type), `part-NNNNNN.len.npy` (each document's length) and `part-NNNNNN.json` (counts), the JSON written
last: a part with its JSON is finished, anything else is a leftover of an interrupted worker and is
written again. Every file goes in under a temporary name and is renamed, so two preparations of the same
data at once (or a rerun beside a stale worker) never see half a file; both write the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from phalanx.data.corpus import Source
from phalanx.data.tokenizer import SpecialTokens, encode_documents, with_specials
from phalanx.data.units import Unit, unit_documents
from phalanx.errors import PhalanxError

ENCODE_CHUNK = 256  # documents handed to the Rust encoder at once


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to encode: the tokenizer's JSON and its special tokens (a Tokenizer object
    does not pickle with them, data/tokenizer.py)."""

    json: str
    specials: SpecialTokens

    def load(self) -> Tokenizer:
        digest = hashlib.sha256(self.json.encode()).hexdigest()
        if digest not in _LOADED:  # once per worker process, not once per unit; only the latest is kept
            _LOADED.clear()
            _LOADED[digest] = with_specials(Tokenizer.from_str(self.json), self.specials)
        return _LOADED[digest]


_LOADED: dict[str, Tokenizer] = {}


@dataclass(frozen=True)
class UnitJob:
    """Tokenise unit number `index` of the corpus into its part in `store`."""

    index: int
    unit: Unit
    source: Source
    text_field: str
    store: Path
    dtype: str  # the shards' token type ("<u2" or "<u4")

    def run(self, spec: TokenizerSpec) -> dict:
        """The part's counts; {"error": message} for bad input, which the caller raises in unit order."""
        counts: dict = {"records": 0}  # the rows read, filled in as the unit is read
        try:
            docs = unit_documents(self.unit, self.source, self.text_field, counts)
            token_docs = encode_documents(spec.load(), docs, chunk_size=ENCODE_CHUNK)
            return PartStore(self.store).write(self.index, token_docs, np.dtype(self.dtype), counts)
        except PhalanxError as e:
            return {"error": str(e)}


class PartStore:
    """The staging directory of one preparation: its parts and the tokenizer they were encoded with."""

    def __init__(self, dir: Path):
        self.dir = Path(dir)

    def _file(self, index: int, suffix: str) -> Path:
        return self.dir / f"part-{index:06d}{suffix}"

    def finished(self, index: int) -> dict | None:
        """The counts of a finished part, or None."""
        try:
            return json.loads(self._file(index, ".json").read_text())
        except (OSError, ValueError):
            return None

    def read(self, index: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, document lengths) of a finished part."""
        tokens = np.fromfile(self._file(index, ".bin"), dtype=dtype)
        lengths = np.load(self._file(index, ".len.npy"))
        if int(lengths.sum()) != tokens.size:
            raise PhalanxError(f"{self._file(index, '.bin')} is damaged; delete {self.dir} to tokenise again")
        return tokens, lengths

    def write(self, index: int, token_docs, dtype: np.dtype, counts: dict) -> dict:
        """Write a part from its documents' token arrays; `counts` (complete once they are through) goes
        into its JSON."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tag = f".{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
        tmp = {s: self._file(index, s + tag) for s in (".bin", ".len.npy", ".json")}
        lengths: list[int] = []
        try:
            with open(tmp[".bin"], "wb", buffering=1 << 20) as f:
                for ids in token_docs:
                    f.write(ids.astype(dtype, copy=False).tobytes())
                    lengths.append(len(ids))
            with open(tmp[".len.npy"], "wb") as f:
                np.save(f, np.asarray(lengths, dtype=np.int64))
            meta = {**counts, "documents": len(lengths), "tokens": int(sum(lengths))}
            tmp[".json"].write_text(json.dumps(meta))
            for suffix in (".bin", ".len.npy", ".json"):  # the JSON last: its presence means finished
                os.replace(tmp[suffix], self._file(index, suffix))
            return meta
        finally:
            for path in tmp.values():
                path.unlink(missing_ok=True)
