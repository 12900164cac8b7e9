#!/bin/bash
# First start: initdb with the POSTGRES_* settings (password auth over TCP),
# then run the server in the foreground as PID 1.
set -euo pipefail
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
if [[ ! -s "$PGDATA/PG_VERSION" ]]; then
    : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
    pwfile="$(mktemp)"
    printf '%s' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    if [[ "$db" != postgres ]]; then
        postgres --single -D "$PGDATA" -j postgres >/dev/null <<<"CREATE DATABASE \"$db\" OWNER \"$user\";"
    fi
fi
exec postgres -D "$PGDATA"
