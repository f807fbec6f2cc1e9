"""`phalanx serve`: check where it may listen, load the model, start the engine and run uvicorn.

Secure by default: loopback only unless an API key (16 characters or more, as the dashboard's token)
guards every endpoint; the socket is bound before the model loads, so a taken port fails at once with
one clear line.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from phalanx.errors import PhalanxError
from phalanx.http_auth import check_secret
from phalanx.http_guard import server_hosts
from phalanx.listen import bind, is_loopback
from phalanx.parallel.device import cpu_has_bf16_units

if TYPE_CHECKING:
    from phalanx.serve.core.contract import EngineObserver, ServingEngine
    from phalanx.serve.core.served import ServedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENGINES = ("torch", "llamacpp", "vllm")
QUANTIZE = ("none", "int8")


def check_listen(host: str, api_key: str | None) -> None:
    check_secret(api_key, "the API key (--api-key or PHALANX_API_KEY)")
    if not is_loopback(host) and not api_key:
        raise PhalanxError(
            f"refusing to listen on {host} without an API key: anyone who can reach it could use "
            "the model; pass --api-key KEY (or set PHALANX_API_KEY), or keep --host 127.0.0.1"
        )


def pick_device(
    device: str,
    dtype: str,
    quantize: str = "none",
    serving: bool = False,
) -> tuple[torch.device, torch.dtype]:
    """The GPU with bf16 if there is one, else the CPU in float32. For a server (`serving`), `auto` on a
    CPU with bf16 matrix units is bfloat16, as training's is: decoding there ran 1.4-1.5x float32's
    tokens/s at 1 to 16 streams (BENCHMARKS.md), and greedy tokens stay the same alone and in a batch
    (the engine checks its bf16 rows at start); `generate` and a local `chat` keep float32 there.
    int8 weights compute in bfloat16."""
    from phalanx.parallel.device import compute_dtype
    from phalanx.parallel.device import pick_device as pick_torch_device

    if device not in ("auto", "cpu", "cuda") or dtype not in ("auto", *DTYPES):
        raise PhalanxError(
            f"--device must be auto|cpu|cuda and --dtype auto|{'|'.join(DTYPES)} (got {device}, {dtype})"
        )
    if quantize not in QUANTIZE:
        raise PhalanxError(f"--quantize must be one of {', '.join(QUANTIZE)}, not {quantize!r}")
    torch_device = pick_torch_device(device)
    if dtype == "auto" and quantize == "int8":
        dtype = "bfloat16"
    elif dtype == "auto" and torch_device.type == "cpu":
        dtype = "bfloat16" if serving and cpu_has_bf16_units() else "float32"
    return torch_device, compute_dtype(dtype, torch_device)


def build_engine(
    kind: str,
    served: ServedModel,
    slots: int,
    max_queue: int,
    context: int | None,
    observer: EngineObserver | None,
    dtype: torch.dtype = torch.float32,
    tensor_parallel: int = 1,
    threads: int | None = None,
) -> ServingEngine:
    """The engine under the APIs: phalanx's own (torch), llama.cpp on a GGUF export or vLLM on an HF export."""
    if kind == "torch":
        from phalanx.serve.engines.torch_engine import Engine

        return Engine(
            served.loaded.model,
            served.loaded.tokenizer,
            slots=slots,
            max_queue=max_queue,
            context=context,
            observer=observer,
        )
    if kind == "llamacpp":
        if served.loaded.format != "gguf":
            raise PhalanxError(
                f"--engine llamacpp serves a GGUF export, and {served.source} is not one; write one "
                f"with: phalanx export {served.source} --format gguf --out DIR (--dtype f16, q8_0, ...)"
            )
        from phalanx.serve.engines.llamacpp_engine import LlamaCppEngine

        return LlamaCppEngine(
            served.loaded.checkpoint,
            served.loaded.tokenizer,
            slots=slots,
            max_queue=max_queue,
            context=context,
            threads=torch.get_num_threads(),
            observer=observer,
        )
    if kind == "vllm":
        if served.loaded.format != "safetensors":
            raise PhalanxError(
                f"--engine vllm serves a Hugging Face export, and {served.source} is not one; write "
                f"one with: phalanx export {served.source} --format hf --out DIR"
            )
        from phalanx.serve.engines.vllm_engine import VllmEngine

        return VllmEngine(
            served.loaded.checkpoint,
            served.loaded.tokenizer,
            dtype,
            slots=slots,
            max_queue=max_queue,
            context=context,
            tensor_parallel=tensor_parallel,
            threads=threads,
            observer=observer,
        )
    raise PhalanxError(f"--engine must be one of {', '.join(ENGINES)}, not {kind!r}")


def serve(
    path: Path,
    host: str,
    port: int,
    api_key: str | None,
    model_name: str | None,
    slots: int,
    max_queue: int,
    context: int | None,
    device: str,
    dtype: str,
    threads: int | None = None,
    log_level: str = "info",
    allowed_hosts: tuple[str, ...] = (),
    engine_kind: str = "torch",
    quantize: str = "none",
    tensor_parallel: int = 1,
    trusted_proxies: tuple[str, ...] = (),
) -> None:
    import uvicorn

    from phalanx.http_server import server_config
    from phalanx.serve.core.served import load_served_model
    from phalanx.serve.http.app import create_app
    from phalanx.serve.http.metrics import ServeMetrics

    check_listen(host, api_key)
    if engine_kind not in ENGINES:
        raise PhalanxError(f"--engine must be one of {', '.join(ENGINES)}, not {engine_kind!r}")
    if quantize != "none" and engine_kind != "torch":
        raise PhalanxError(
            f"--quantize is for the torch engine; --engine {engine_kind} serves the GGUF's own "
            "weight types (phalanx export --format gguf --dtype q8_0 ...)"
        )
    if tensor_parallel != 1 and engine_kind != "vllm":
        raise PhalanxError(
            "--tensor-parallel is for --engine vllm; the torch and llama.cpp engines serve on one device"
        )
    torch_device, torch_dtype = pick_device(device, dtype, quantize, serving=True)
    if threads is not None:
        # On a CPU shared with other work, fewer threads than cores avoid stalls at every op's barrier.
        torch.set_num_threads(threads)
    sock = bind(host, port)
    # vLLM loads the export onto its devices itself; phalanx's copy (for /api/show and embeddings) stays on the CPU.
    served = load_served_model(path, "cpu" if engine_kind == "vllm" else torch_device, torch_dtype, name=model_name)
    if quantize == "int8":
        from phalanx.serve.engines.int8_weights import quantize_linear_weights

        quantize_linear_weights(served.loaded.model)
    max_seq_len = served.loaded.model.args.max_seq_len
    if context is not None and context > max_seq_len:
        raise PhalanxError(f"--context {context} is longer than the model's max_seq_len {max_seq_len}")
    metrics = ServeMetrics()
    engine = build_engine(
        engine_kind, served, slots, max_queue, context, metrics, torch_dtype, tensor_parallel, threads
    )
    app = create_app(served, engine, metrics, api_key=api_key, allowed_hosts=server_hosts(host, allowed_hosts))
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    runs_on = {
        "torch": f"{torch_dtype}{', int8 weights' if quantize == 'int8' else ''}, {torch_device}",
        "llamacpp": "llama.cpp, cpu",
        "vllm": f"vLLM, {torch_dtype}, tensor parallel {tensor_parallel}",
    }[engine_kind]
    print(
        f"phalanx serve: model '{served.name}' ({served.parameters / 1e6:.1f}M parameters, {runs_on}), {slots} slots x {engine.context} tokens, KV cache "
        f"{engine.kv_cache_bytes / 2**20:.1f} MiB, queue {max_queue}, {torch.get_num_threads()} threads"
        f"{', API key required' if api_key else ''}",
        flush=True,
    )
    print(f"phalanx serve: listening on http://{shown}:{bound_port}", flush=True)
    config = server_config(app, log_level, trusted_proxies, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
