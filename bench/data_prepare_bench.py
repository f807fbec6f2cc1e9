"""What `phalanx data prepare` reaches against the tokenizer's own ceiling, and the memory it holds.

Makes a JSON Lines corpus of --gigabytes (one file, so it is cut into byte-range units; documents of
1-6 KB of Zipf-distributed words), trains a tokenizer on its first 20 MB (outside every timing: the
preparations are given it, so they time tokenising and writing shards alone), then, each in its own
process on the same cores:
  - the raw ceiling: HF tokenizers' encode_batch_fast over the same texts on every core, in batches of
    as many documents as phalanx hands it (the file read and parsed untimed), nothing written;
  - phalanx preparation (prepare_data: units, parts, merge, shards) at each --workers count;
and reports MB of corpus per second, each preparation's ratio to the ceiling (target 80%), and peak RSS
(the preparing process, and the largest of its worker processes).

Usage: .venv/bin/python bench/data_prepare_bench.py [--gigabytes 1] [--workers 1,2] [--dir DIR] [--json]
Smoke check: .venv/bin/python bench/data_prepare_bench.py --gigabytes 0.05
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VOCAB = 8192
SLICE_BYTES = 16 << 20


def make_corpus(path: Path, gigabytes: float, seed: int = 0) -> int:
    """A .jsonl of about `gigabytes`; 4,000 distinct documents written over and over (generating every
    byte afresh would take longer than preparing it), each line with its number so no two are equal."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    words = ["".join(rng.choice(letters, int(rng.integers(1, 11)))) for _ in range(20_000)]
    weights = 1 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    docs = []
    for _ in range(4000):
        n = int(rng.integers(150, 1000))
        docs.append(" ".join(rng.choice(words, n, p=weights)).capitalize() + ".")
    target = int(gigabytes * 1e9)
    written = 0
    with path.open("w") as f:
        i = 0
        while written < target:
            line = json.dumps({"text": f"{i}. {docs[i % len(docs)]}"}) + "\n"
            f.write(line)
            written += len(line)
            i += 1
    return path.stat().st_size


def train(corpus: Path, out: Path) -> None:
    from phalanx.data.tokenizer import train_tokenizer
    from phalanx.data.tokenizer_sample import capped

    texts = (json.loads(line)["text"] for line in corpus.open())
    train_tokenizer(capped(texts, 20 << 20), VOCAB).save(str(out))


def ceiling(corpus: Path, tokenizer: Path) -> dict:
    from tokenizers import Tokenizer

    from phalanx.data.parts import ENCODE_CHUNK

    tok = Tokenizer.from_file(str(tokenizer))
    seconds, tokens = 0.0, 0
    with corpus.open("rb") as f:
        while lines := f.readlines(SLICE_BYTES):
            texts = [json.loads(line)["text"] for line in lines]
            for i in range(0, len(texts), ENCODE_CHUNK):  # batches as phalanx hands them over: no giant ones
                start = time.perf_counter()
                encodings = tok.encode_batch_fast(texts[i : i + ENCODE_CHUNK], add_special_tokens=False)
                seconds += time.perf_counter() - start
                tokens += sum(len(e) for e in encodings)
    return {"seconds": seconds, "tokens": tokens}


def prepare(corpus: Path, tokenizer: Path, workers: int, cache: Path) -> dict:
    from phalanx.data.prepare import prepare_data

    start = time.perf_counter()
    data = prepare_data([str(corpus)], corpus.parent, cache, VOCAB, str(tokenizer), 0.05, workers=workers)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": data.train_tokens + data.val_tokens, "dir": str(data.dir)}


def measured(what: str, *args: str) -> dict:
    """Run one measurement in a fresh process: its peak RSS is its own, and one run's pages cached in
    memory are no other's."""
    command = [sys.executable, __file__, "--measure", what, *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(what: str, args: list[str]) -> None:
    corpus, tokenizer = Path(args[0]), Path(args[1])
    if what == "ceiling":
        result = ceiling(corpus, tokenizer)
    else:
        result = prepare(corpus, tokenizer, int(args[2]), Path(args[3]))
    kib = 1024  # ru_maxrss is in KiB on Linux
    result["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib / 1e6
    result["worker_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib / 1e6
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--dir", default=None, help="where the corpus and caches go (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure[0], args.measure[1:])
        return
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="phalanx-data-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        corpus, tokenizer = root / "corpus.jsonl", root / "tokenizer.json"
        size = make_corpus(corpus, args.gigabytes)
        train(corpus, tokenizer)
        top = measured("ceiling", str(corpus), str(tokenizer))
        rows = [{"what": "ceiling: encode_batch_fast, all cores", **top}]
        for workers in [int(w) for w in args.workers.split(",")]:
            cache = root / f"cache-{workers}"
            result = measured("prepare", str(corpus), str(tokenizer), str(workers), str(cache))
            rows.append({"what": f"phalanx prepare, {workers} worker(s)", **result})
            shutil.rmtree(cache, ignore_errors=True)
        for row in rows:
            row["mb_per_s"] = size / 1e6 / row["seconds"]
            row["of_ceiling"] = row["mb_per_s"] / rows[0]["mb_per_s"]
        report = {"corpus_mb": size / 1e6, "tokens": top["tokens"], "rows": rows}
        if args.json:
            print(json.dumps(report, indent=2))
            return
        print(f"corpus: {size / 1e6:.0f} MB of JSON Lines, {top['tokens']:,} tokens (vocab {VOCAB})")
        print(f"{'':40} {'MB/s':>8} {'of ceiling':>11} {'peak RSS MB':>12} {'worker RSS MB':>14}")
        for row in rows:
            worker = f"{row['worker_rss_mb']:.0f}" if row["worker_rss_mb"] else "-"
            print(
                f"{row['what']:40} {row['mb_per_s']:8.1f} {row['of_ceiling']:10.0%} {row['rss_mb']:12.0f} {worker:>14}"
            )
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
