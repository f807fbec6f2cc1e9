"""Run stores to test against: SQLite always, PostgreSQL when a server is there.

PostgreSQL comes from PHALANX_TEST_POSTGRES_URL (`.ci/run` starts a real server with
scripts/start_postgres.sh and exports it); without it those tests are skipped, saying why.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest

POSTGRES_URL = os.environ.get("PHALANX_TEST_POSTGRES_URL")
# Debian's Chromium, driven by playwright (never `playwright install`); browser tests skip without it.
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A fresh page that records script errors and console errors (a CSP violation shows up there)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.on("console", lambda message: page.errors.append(message.text) if message.type == "error" else None)
    yield page
    context.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'phalanx.db'}"
        return
    if not POSTGRES_URL:
        pytest.skip(
            "no PostgreSQL server: set PHALANX_TEST_POSTGRES_URL (bash scripts/start_postgres.sh "
            "starts one; .ci/run does)"
        )
    with fresh_postgres_database() as url:  # a database per test: tests never see each other's runs
        yield url


@contextlib.contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """A new, empty database on the PHALANX_TEST_POSTGRES_URL server (its URL), dropped afterwards."""
    import sqlalchemy as sa

    name = f"phalanx_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(
        POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.engine.make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
