"""Which pip extra a command needs, and the one line that says so when it is missing.

`pip install phalanx` is enough to prepare data, plan, preflight and train; serving, the run store with its
dashboard, and exports come with extras (pyproject.toml's [project.optional-dependencies];
tests/test_extras.py keeps this table and that one in step). A command that needs an extra calls
require() before it imports the modules that would fail, so a missing package is one line naming the extra
and exit 2, not a traceback from deep inside an import.
"""

from __future__ import annotations

from importlib.util import find_spec

from phalanx.errors import PhalanxError

# Extra -> the modules phalanx imports from it (import names: prometheus_client is PyPI's prometheus-client).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    # Reading and writing Hugging Face (safetensors) and GGUF exports: `phalanx export`, and every command
    # that loads one (run/model_loader.py imports both readers).
    "export": ("gguf", "safetensors"),
    # `phalanx serve`, `chat` and `generate`: the HTTP APIs, the chat client, JSON-schema token masks, the
    # server's /metrics, and the export readers (they serve an export as well as a run).
    "serve": ("fastapi", "uvicorn", "httpx", "llguidance", "prometheus_client", "gguf", "safetensors"),
    # The run store (SQLAlchemy, with alembic migrations), the dashboard (with plotly.js from the plotly
    # package) and the /metrics of a training node or the dashboard.
    "observe": ("sqlalchemy", "alembic", "fastapi", "uvicorn", "prometheus_client", "plotly"),
    "postgres": ("psycopg",),
    "tensorboard": ("tensorboard",),
    # data.sources of Hugging Face datasets (saved or on the hub) and of .jsonl.zst files: data/readers/
    # checks for the one package a source needs (data/readers/optional.py), not the whole extra.
    "data": ("datasets", "zstandard"),
    # `phalanx eval --tasks`: lm-evaluation-harness (with its [api] models).
    "eval": ("lm_eval",),
}
# Extras that `all` leaves out: the harness brings dozens of packages (metrics, tokenisers, data sets)
# that no other command needs.
NOT_IN_ALL = frozenset({"eval"})


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here (none: the extra is installed)."""
    return [name for name in EXTRA_MODULES[extra] if not _importable(name)]


def installed(extra: str) -> bool:
    return not missing(extra)


def require(extra: str, what: str) -> None:
    """Raise a PhalanxError (exit 2) saying that `what` (a command, a config key) needs `extra`, unless
    every module of it can be imported."""
    absent = missing(extra)
    if absent:
        raise PhalanxError(
            f"{what} needs phalanx's {extra} extra ({', '.join(absent)} "
            f"{'is' if len(absent) == 1 else 'are'} not installed): pip install 'phalanx[{extra}]'"
        )


def _importable(name: str) -> bool:
    # find_spec rather than an import: it costs microseconds where fastapi's import costs half a second,
    # and a package that is installed but broken is better shown by its own traceback than called missing.
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):  # a dotted name whose parent fails, a module without a spec
        return False
