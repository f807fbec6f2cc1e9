"""lm-evaluation-harness on a model, through phalanx's own server and batched engine.

The harness's `local-completions` model talks to a LocalServer on 127.0.0.1: multiple-choice and
perplexity tasks are scored with echo + logprobs on /v1/completions, several prompts a request (the
batch size), generation tasks decoded greedily by the engine. The harness finds the tokenizer through
the server's /tokenize and /tokenizer_info, so any model phalanx serves (a run, a checkpoint, an HF or
GGUF export) is evaluated without a copy of it in transformers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.console import debug_enabled, say
from phalanx.eval.local_server import LocalServer
from phalanx.eval.tasks import load_tasks

if TYPE_CHECKING:
    from phalanx.run.model_loader import LoadedModel

# Loggers of the harness and the libraries under it that log every request or dataset step at INFO.
QUIET_LOGGERS = ("lm_eval", "lm-eval", "httpx", "datasets", "filelock", "urllib3")


def evaluate_tasks(
    path: Path,
    tasks: list[str],
    limit: int | None = None,
    batch_size: int = 8,
    include_path: Path | None = None,
    device: str = "auto",
    log_samples: bool = False,
) -> tuple[dict[str, Any], LoadedModel]:
    """lm-eval's simple_evaluate result for `tasks` on the model at `path`, and the model evaluated (its
    `checkpoint` says which). Tasks are checked before the model loads."""
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    if not debug_enabled():
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    manager, built = load_tasks(tasks, include_path)
    server = LocalServer(path, slots=batch_size, device=device)
    say(f"evaluating {server.served.loaded.checkpoint} on {', '.join(tasks)} (batch size {batch_size})")
    with server:
        model = LocalCompletionsAPI(
            base_url=f"{server.url}/v1/completions",
            tokenizer_backend="remote",  # the server's own tokenizer, through /tokenize and /tokenizer_info
            model=server.served.name,
            batch_size=batch_size,
            max_length=server.context,  # longer requests would be refused: the harness truncates to it
            header={"Authorization": f"Bearer {server.api_key}"},  # the scoring requests
            auth_token=server.api_key,  # the tokenizer requests
            max_retries=1,  # a refused request is refused again; a retry only hides the error for minutes
        )
        results = lm_eval.simple_evaluate(
            model=model, tasks=built, limit=limit, task_manager=manager, log_samples=log_samples
        )
    return results, server.served.loaded
