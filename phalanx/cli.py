"""The `phalanx` command line: one typer app to which every stage folder adds its own commands.

Bad input raises PhalanxError anywhere below; `main` prints it as one line and exits with the error's
code (phalanx/errors.py has the table), with the traceback only under --debug.
"""

from __future__ import annotations

import os
import signal
import sys

import typer
from rich.text import Text

from phalanx.console import DEBUG_ENV, err
from phalanx.errors import PhalanxError, StoppedBySignal
from phalanx.eval.commands import register as register_eval
from phalanx.export.commands import register as register_export
from phalanx.job.commands import register as register_job
from phalanx.launch.cluster.commands import register as register_cluster
from phalanx.observe.commands import register as register_observe
from phalanx.plan.commands import register as register_plan
from phalanx.preflight.commands import register as register_preflight
from phalanx.serve.cli.commands import register as register_serve
from phalanx.train.commands import register as register_train

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train, keep alive, observe and serve Llama-style language models on any accelerator.",
    epilog="Example: phalanx train (the demo), then phalanx chat runs/demo. "
    "Each command's --help has its own examples.",
)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks (may also follow any command).")):
    pass


# The order of the help listing: the life of a model, from data to serving.
for register in (
    register_job,
    register_cluster,
    register_train,
    register_serve,
    register_eval,
    register_observe,
    register_export,
    register_plan,
    register_preflight,
):
    register(app)


def main() -> None:
    debug = "--debug" in sys.argv[1:] or os.environ.get(DEBUG_ENV) == "1"
    sys.argv = [a for a in sys.argv if a != "--debug"]
    if debug:
        os.environ[DEBUG_ENV] = "1"  # for the ranks too: torch's own warnings and log lines are shown
    # A SIGTERM (a scheduler's, `kill`) that comes before a command takes it over itself (the launcher
    # once the ranks start, uvicorn once a server runs) ends the command as Ctrl-C does: through its
    # clean-up, with one line and exit 143, rather than as a silent kill.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        try:
            code = app(standalone_mode=False)  # click's errors come here, to be one line like ours
        except BaseException:
            if _terminated:  # whatever the SIGTERM became on its way up
                raise _Terminated() from None
            raise
    except PhalanxError as exc:
        if debug:
            raise
        _error(str(exc))
        sys.exit(exc.exit_code)
    except typer.TyperException as exc:  # the parser's: a bad option value, a missing argument, a typo
        if type(exc).__name__ == "NoArgsIsHelpError":
            sys.exit(2)  # the help has been printed
        if debug:
            raise
        ctx = getattr(exc, "ctx", None)
        _error(exc.format_message() + (f" (see `{ctx.command_path} --help`)" if ctx is not None else ""))
        sys.exit(exc.exit_code)
    except typer.Abort:
        _error("aborted")
        sys.exit(1)
    except _Terminated:
        stopped = StoppedBySignal(signal.SIGTERM, "the same command starts it again")
        _error(str(stopped))
        sys.exit(stopped.exit_code)
    code = code if type(code) is int else 0  # an exit code (typer.Exit), or whatever a command returned
    if code == 130:  # typer's answer to Ctrl-C inside a command
        _error("interrupted (Ctrl-C)")
    sys.exit(code)


class _Terminated(BaseException):
    """SIGTERM, raised where the main thread is. A BaseException, as KeyboardInterrupt is, so that a
    library's `except Exception` does not swallow it; a library that wraps it into an error of its own
    (pydantic's serializer does) still ends the command as a SIGTERM, by the flag below."""


_terminated = False


def _stop_on_sigterm(signum: int, frame: object) -> None:
    global _terminated
    _terminated = True
    raise _Terminated()


def _error(message: str) -> None:
    err.print(Text("error: ", style="bold red") + Text(message), soft_wrap=True)


if __name__ == "__main__":
    main()
