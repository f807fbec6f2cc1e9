"""What a training job does with the run store and /metrics on an install without the observe extra.

Training needs neither (`pip install phalanx` trains), so the store a config gets by default (observe.store
null: an SQLite file in the runs root) is skipped with one note; `phalanx runs import RUN_DIR` copies the
run in later, once the extra is installed. What a config asks for by name (a store URL or file,
observe.metrics_port, observe.tensorboard) is refused before anything is written instead: a setting must
never be accepted and then ignored.
"""

from __future__ import annotations

from phalanx.config.schema import Config
from phalanx.console import say
from phalanx.extras import installed, require
from phalanx.observe.redaction import redact_url

_noted = False  # the note is said once per process, however many stages ask (quarantine, preflight, store)


def check_observe_settings(config: Config) -> None:
    """A PhalanxError (exit 2, naming the extra) for each observe setting this install cannot honour."""
    if config.observe.store not in (None, "none"):
        _require_named_store(config.observe.store)
    if config.observe.metrics_port is not None:
        require("observe", "observe.metrics_port")
    if config.observe.tensorboard:
        require("tensorboard", "observe.tensorboard=true")


def store_in_use(config: Config) -> bool:
    """Whether this process should open the run store for `config`: not with observe.store=none, nor
    (after one note) with the default store where the observe extra is missing. A store named in the
    config without the extra raises, as check_observe_settings does."""
    global _noted
    if config.observe.store == "none":
        return False
    if installed("observe"):
        return True
    if config.observe.store is not None:
        _require_named_store(config.observe.store)
    if not _noted:
        _noted = True
        say(
            "note: the run store is skipped: it needs phalanx's observe extra (pip install 'phalanx[observe]'); "
            "`phalanx runs import RUN_DIR` copies a run in later"
        )
    return False


def _require_named_store(store: str) -> None:
    require("observe", f"observe.store={redact_url(store)}")
