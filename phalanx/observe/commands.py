"""The command-line front of phalanx dashboard and phalanx runs: register() adds its commands to the main typer app."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from phalanx.observe.runs_cli import runs_app

    app.add_typer(runs_app, name="runs")
    _register_dashboard(app)


# -- phalanx dashboard ---------------------------------------------------------------------------------
def _register_dashboard(app: typer.Typer) -> None:
    # Annotations name only builtins: this module's globals are shared with the `runs` commands.
    @app.command()
    def dashboard(
        runs: str | None = typer.Option(
            None, "--runs", metavar="DIR", help="Runs root whose store file phalanx.db to show (default ./runs)."
        ),
        store: str | None = typer.Option(
            None, "--store", metavar="URL", help="A store URL (postgresql://...) or file, instead of --runs."
        ),
        host: str = typer.Option(
            "127.0.0.1", "--host", metavar="ADDRESS", help="Address to listen on; beyond loopback needs --token."
        ),
        port: int = typer.Option(8765, "--port", min=0, max=65535, help="Port to listen on (0: any free port)."),
        token: str | None = typer.Option(
            None,
            "--token",
            metavar="TOKEN",
            envvar="PHALANX_DASHBOARD_TOKEN",
            help="Require this token (Bearer header or /login form) from every client.",
        ),
        allowed_hosts: list[str] = typer.Option(
            [],
            "--allowed-host",
            metavar="NAME",
            envvar="PHALANX_ALLOWED_HOSTS",
            help="A Host name to answer besides loopback names, IP addresses and this machine's name "
            "(repeatable; .example.org: all names under it).",
        ),
        proxies: list[str] = typer.Option(
            [],
            "--trusted-proxy",
            metavar="ADDRESS",
            envvar="PHALANX_TRUSTED_PROXIES",
            help="An address or network (repeatable) whose X-Forwarded-For header names the client: your reverse "
            "proxy. Without one the header is ignored, so a client cannot pick its own address.",
        ),
    ) -> None:
        """Serve the web dashboard: runs, live curves, rank heatmap, events, goodput, /metrics.

        Examples:
        phalanx dashboard
        phalanx dashboard --runs /scratch/runs --port 9000
        """
        from pathlib import Path

        from phalanx.errors import PhalanxError
        from phalanx.extras import require

        require("observe", "phalanx dashboard")  # before the imports below, which need it
        from phalanx.http_guard import server_hosts
        from phalanx.http_server import trusted_proxies
        from phalanx.observe.app import bind, create_app, serve
        from phalanx.observe.auth import check_exposure
        from phalanx.observe.store import RunStore, redact

        if runs is not None and store is not None:
            raise PhalanxError("give --runs DIR or --store URL, not both")
        check_exposure(host, token)
        trusted = trusted_proxies(proxies)
        run_store = RunStore.open(store, Path(runs or "runs"), create=False)
        sock = bind(host, port)
        shown = f"[{host}]" if ":" in host else host
        print(
            f"phalanx dashboard at http://{shown}:{sock.getsockname()[1]}/ (store {redact(run_store.url)}"
            f"{', token required' if token else ''}); Ctrl-C stops it",
            flush=True,
        )
        try:
            serve(
                create_app(run_store, token, allowed_hosts=server_hosts(host, allowed_hosts)),
                sock,
                trusted_proxies=trusted,
            )
        finally:
            run_store.close()
