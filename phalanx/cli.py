"""The `phalanx` command line: one typer app to which every stage folder adds its own commands.

Bad input raises PhalanxError anywhere below; `main` prints it as one line and exits with the error's
code (phalanx/errors.py has the table), with the traceback only under --debug.
"""

from __future__ import annotations

import os
import sys

import typer
from rich.text import Text

from phalanx.config.commands import register as register_config
from phalanx.console import err
from phalanx.errors import PhalanxError
from phalanx.export.commands import register as register_export
from phalanx.job.commands import register as register_job
from phalanx.observe.commands import register as register_observe
from phalanx.plan.commands import register as register_plan
from phalanx.preflight.commands import register as register_preflight
from phalanx.serve.commands import register as register_serve
from phalanx.train.commands import register as register_train

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train, keep alive, observe and serve Llama-style language models on any accelerator.")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks (may also follow any command).")):
    pass


# The order of the help listing: the life of a model, from data to serving.
for register in (register_job, register_config, register_train, register_serve, register_observe, register_export,
                 register_plan, register_preflight):
    register(app)


def main() -> None:
    debug = "--debug" in sys.argv[1:] or os.environ.get("PHALANX_DEBUG") == "1"
    sys.argv = [a for a in sys.argv if a != "--debug"]
    try:
        app()
    except PhalanxError as exc:
        if debug:
            raise
        err.print(Text("error: ", style="bold red") + Text(str(exc)), soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
