#!/usr/bin/env bash
# Start a throwaway PostgreSQL server on 127.0.0.1 for the run store's tests (installs the Debian
# package if needed) and print the URL to export as PHALANX_TEST_POSTGRES_URL.
# Usage: export PHALANX_TEST_POSTGRES_URL=$(bash scripts/start_postgres.sh)
set -euo pipefail
PORT=${PHALANX_PG_PORT:-54329}
DATA=${PHALANX_PG_DATA:-/tmp/phalanx-postgres}
if ! ls -d /usr/lib/postgresql/*/bin >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; } >&2
fi
BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
# initdb refuses to run as root: the server runs as the package's postgres user.
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/bash -c "$*"; else bash -c "$*"; fi; }
if [ ! -f "$DATA/PG_VERSION" ]; then
  mkdir -p "$DATA" && { [ "$(id -u)" != 0 ] || chown postgres "$DATA"; }
  as_pg "$BIN/initdb -D $DATA -A trust -U postgres" >&2
fi
if ! as_pg "$BIN/pg_ctl -D $DATA status" >/dev/null 2>&1; then
  as_pg "$BIN/pg_ctl -D $DATA -w -l $DATA/server.log -o \"-p $PORT -k /tmp -c listen_addresses=127.0.0.1\" start" >&2
fi
as_pg "$BIN/psql -h 127.0.0.1 -p $PORT -U postgres -tc \"SELECT 1 FROM pg_database WHERE datname='phalanx_test'\"" \
  | grep -q 1 || as_pg "$BIN/createdb -h 127.0.0.1 -p $PORT -U postgres phalanx_test" >&2
echo "postgresql://postgres@127.0.0.1:$PORT/phalanx_test"
