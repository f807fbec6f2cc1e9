"""What a JSON schema costs `phalanx serve` since schemas compile in a worker process (schema_compiler.py):
the worker's start, a small and a large schema's compile, a repeat (cached), and the refusal of a schema
that crashes its compiler (the worker's death and the next one's start included).

    .venv/bin/python bench/serve_schema_compile.py [--vocab 4096]

Prints one line per case: the median of 5 (the crash and the first start once each, since they are what
they measure only once).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from phalanx.data.corpus import iter_documents, resolve_sources
from phalanx.data.tokenizer import train_tokenizer
from phalanx.serve.core.schema_compiler import FormatError, SchemaCompiler

SMALL = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}
LARGE = {
    "type": "object",
    "properties": {f"p{i}": {"anyOf": [{"type": "string"}, {"type": "integer"}]} for i in range(3000)},
}
CRASH = {
    "$defs": {**{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(2500)}, "d2500": {"type": "string"}},
    "$ref": "#/$defs/d0",
}


async def never_gone() -> bool:
    return False


async def timed(compiler: SchemaCompiler, schema: dict) -> tuple[float, str]:
    started = time.perf_counter()
    try:
        await compiler.grammar(schema, never_gone)
        outcome = "ok"
    except FormatError as e:
        outcome = f"400: {str(e)[:60]}"
    return time.perf_counter() - started, outcome


async def main(vocab: int) -> None:
    sources = [s for s in resolve_sources(["builtin:shakespeare"], Path.cwd())][:4]
    tokenizer = train_tokenizer(list(iter_documents(sources)), vocab)
    compiler = SchemaCompiler(tokenizer.to_str(), eos_id=0)
    print(f"vocabulary {tokenizer.get_vocab_size():,}")
    seconds, outcome = await timed(compiler, SMALL)
    print(f"first schema, the worker's start included: {seconds * 1000:8.1f} ms  {outcome}")
    for name, schema in (("small", SMALL), ("3,000 properties", LARGE)):
        runs = []
        for i in range(5):
            compiler._cache.clear()
            runs.append((await timed(compiler, {**schema, "title": f"run {i}"}))[0])
        print(f"{name} schema: {statistics.median(runs) * 1000:8.1f} ms (median of 5)")
    runs = [(await timed(compiler, SMALL))[0] for _ in range(5)]
    print(f"a repeated schema (cached): {statistics.median(runs) * 1000:8.3f} ms")
    seconds, outcome = await timed(compiler, CRASH)
    print(f"a chain of 2,500 $refs (the worker dies): {seconds * 1000:8.1f} ms  {outcome}")
    seconds, outcome = await timed(compiler, {**SMALL, "title": "after the crash"})
    print(f"the next schema, a new worker's start included: {seconds * 1000:8.1f} ms  {outcome}")
    await compiler.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=4096)
    asyncio.run(main(parser.parse_args().vocab))
