"""The command-line front of phalanx serve and phalanx chat: register() adds its commands to the main typer app."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from phalanx.extras import require

ApiKeyOpt = typer.Option(
    None,
    "--api-key",
    envvar="PHALANX_API_KEY",
    show_envvar=True,
    help="Bearer token every request must send (all endpoints but /health).",
)


def register(app: typer.Typer) -> None:
    @app.command()
    def generate(
        path: Path = typer.Argument(
            ...,
            metavar="RUN_DIR|EXPORT_DIR",  # longer names do not fit 80 columns
            help="A run directory (its newest checkpoint), a checkpoint, an HF or a GGUF export.",
        ),
        prompt: str = typer.Argument("", help="Text to continue."),
        max_new_tokens: int = typer.Option(200, "--max-new-tokens", min=1),
        temperature: Optional[float] = typer.Option(
            None, "--temperature", min=0.0, help="0 picks the likeliest token. [default: 0.8]"
        ),
        top_k: Optional[int] = typer.Option(
            None, "--top-k", min=0, help="Sample among the k likeliest tokens (0: all). [default: 40]"
        ),
        top_p: Optional[float] = typer.Option(
            None,
            "--top-p",
            min=0.0,
            max=1.0,
            help="Sample among the likeliest tokens holding this much probability. [default: 0.9]",
        ),
        repeat_penalty: Optional[float] = typer.Option(
            None, "--repeat-penalty", min=0.0, help="Penalise the last 64 tokens (1: off). [default: 1.1]"
        ),
        seed: Optional[int] = typer.Option(None, "--seed", help="Fix the sampling for repeatable output."),
        device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    ) -> None:
        """Print the prompt and the text a trained model writes after it.

        Decoded by the serving engine with the servers' defaults, so `generate` and `serve` agree.

        Examples:
          phalanx generate runs/demo "ROMEO:" --max-new-tokens 100 --seed 0
          phalanx generate exports/demo-hf "JULIET:" --temperature 0
        """
        require("serve", "phalanx generate")  # it decodes through the serving engine
        from phalanx.serve.cli.generate import generate as generate_from
        from phalanx.serve.cli.generate import generate_options

        options = generate_options(
            max_new_tokens, seed, temperature=temperature, top_k=top_k, top_p=top_p, repeat_penalty=repeat_penalty
        )
        pieces = generate_from(path, prompt, options, device)
        first = next(pieces, "")  # loads the model: errors come before any output
        sys.stdout.write(prompt + first)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")

    @app.command()
    def serve(
        path: Path = typer.Argument(
            ...,
            metavar="RUN_DIR|EXPORT_DIR",
            help="A run directory (its newest checkpoint), a checkpoint, an HF or a GGUF export.",
        ),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; beyond loopback needs --api-key."),
        port: int = typer.Option(11434, "--port", min=0, max=65535, help="Port (0: any free port, printed)."),
        api_key: Optional[str] = ApiKeyOpt,
        model_name: Optional[str] = typer.Option(
            None, "--model-name", help="The name clients ask for (default: the directory's name)."
        ),
        slots: int = typer.Option(8, "--slots", min=1, help="Requests decoded together (KV cache rows)."),
        max_queue: int = typer.Option(
            64, "--max-queue", min=0, help="Requests that may wait for a slot; more are answered 503."
        ),
        context: Optional[int] = typer.Option(
            None, "--context", min=2, help="Tokens per slot (default: the model's max_seq_len)."
        ),
        device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
        dtype: str = typer.Option(
            "auto",
            "--dtype",
            help="auto (bfloat16 on GPU and on CPUs with bf16 units, else float32), float32, bfloat16 or float16.",
        ),
        threads: Optional[int] = typer.Option(
            None, "--threads", min=1, help="CPU threads for the model (default: torch's, one per core)."
        ),
        engine: str = typer.Option(
            "torch",
            "--engine",
            help="torch (phalanx's engine), llamacpp (llama.cpp on a GGUF export) or vllm "
            "(vLLM on a Hugging Face export).",
        ),
        tensor_parallel: int = typer.Option(
            1, "--tensor-parallel", min=1, help="GPUs to shard the model over (vllm engine)."
        ),
        quantize: str = typer.Option(
            "none",
            "--quantize",
            help="none, or int8: weight-only int8 with bfloat16 activations (torch "
            "engine, CPU; half of bf16's weight memory).",
        ),
        log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level (warning: no access log)."),
        allowed_hosts: list[str] = typer.Option(
            [],
            "--allowed-host",
            metavar="NAME",
            envvar="PHALANX_ALLOWED_HOSTS",
            help="A Host name to answer besides loopback names, IP addresses "
            "and this machine's name (repeatable; .example.org: all "
            "names under it).",
        ),
        proxies: list[str] = typer.Option(
            [],
            "--trusted-proxy",
            metavar="ADDRESS",
            envvar="PHALANX_TRUSTED_PROXIES",
            help="An address or network (repeatable) whose X-Forwarded-For header "
            "names the client: your reverse proxy. Without one the header is "
            "ignored, so a client cannot pick its own address.",
        ),
    ) -> None:
        """Serve a model over Ollama's and OpenAI's HTTP APIs, batching concurrent requests.

        Examples:
        phalanx serve runs/demo
        phalanx serve exports/demo-hf --port 8000 --slots 16
        phalanx serve exports/demo-q8 --engine llamacpp
        phalanx serve exports/demo-hf --engine vllm
        phalanx serve runs/demo --quantize int8
        """
        require("serve", "phalanx serve")
        from phalanx.http_server import trusted_proxies
        from phalanx.serve.server import serve as run_server

        run_server(
            path,
            host,
            port,
            api_key or None,
            model_name,
            slots,
            max_queue,
            context,
            device,
            dtype,
            threads,
            log_level,
            tuple(allowed_hosts),
            engine,
            quantize,
            tensor_parallel,
            trusted_proxies(proxies),
        )

    @app.command()
    def chat(
        target: str = typer.Argument(
            ..., metavar="RUN_DIR|EXPORT_DIR|URL", help="A model to load here, or a running server (http://HOST:PORT)."
        ),
        model: Optional[str] = typer.Option(None, "--model", help="Model on the server (default: its first)."),
        system: Optional[str] = typer.Option(None, "--system", help="A system message opening the conversation."),
        temperature: Optional[float] = typer.Option(None, "--temperature", min=0.0, help="0: greedy."),
        top_k: Optional[int] = typer.Option(None, "--top-k", min=0),
        top_p: Optional[float] = typer.Option(None, "--top-p", min=0.0, max=1.0),
        seed: Optional[int] = typer.Option(None, "--seed", help="Fix the sampling for repeatable replies."),
        num_predict: Optional[int] = typer.Option(None, "--num-predict", min=1, help="Most tokens per reply."),
        api_key: Optional[str] = typer.Option(
            None, "--api-key", envvar="PHALANX_API_KEY", show_envvar=True, help="The server's API key, if it needs one."
        ),
        device: str = typer.Option("auto", "--device", help="auto, cpu or cuda (a local model)."),
        context: Optional[int] = typer.Option(None, "--context", min=2, help="Context of a local model."),
        verbose: bool = typer.Option(False, "--verbose", help="Token counts and speed after each reply."),
        no_history: bool = typer.Option(False, "--no-history", help="Keep no history of typed lines."),
    ) -> None:
        """Chat in the terminal like `ollama run`: /? lists the commands, Ctrl-C stops a reply.

        Replies stream as they are generated; /bye or Ctrl-D ends the chat. Piped in, each line is a turn.

        Examples:
          phalanx chat runs/demo --temperature 0.7
          phalanx chat http://127.0.0.1:11434 --api-key KEY
          phalanx chat runs/demo --seed 1 < questions.txt
        """
        require("serve", "phalanx chat")
        from phalanx.serve.cli.chat import run_chat

        given: dict[str, Any] = {
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "seed": seed,
            "num_predict": num_predict,
        }
        run_chat(
            target,
            model,
            system,
            {k: v for k, v in given.items() if v is not None},
            api_key or None,
            device,
            context,
            verbose=verbose,
            history=not no_history,
        )
