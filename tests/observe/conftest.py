"""Run stores to test against: SQLite always, PostgreSQL when a server is there.

PostgreSQL comes from PHALANX_TEST_POSTGRES_URL (`.ci/run` starts a real server with
scripts/start_postgres.sh and exports it); without it those tests are skipped, saying why.
"""

from __future__ import annotations

import os
import uuid

import pytest

POSTGRES_URL = os.environ.get("PHALANX_TEST_POSTGRES_URL")


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'phalanx.db'}"
        return
    if not POSTGRES_URL:
        pytest.skip("no PostgreSQL server: set PHALANX_TEST_POSTGRES_URL (bash scripts/start_postgres.sh "
                    "starts one; .ci/run does)")
    # A fresh database per test, so tests never see each other's runs.
    import sqlalchemy as sa

    name = f"phalanx_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1),
                             isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = POSTGRES_URL.rsplit("/", 1)[0] + "/" + name
    yield url
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()
