#!/usr/bin/env bash
# Writes the Kubernetes base's three secret env files (never committed) with
# random values, next to this script unless a directory is given:
#   database.env        DATABASE_URL, POSTGRES_PASSWORD (for the bundled postgres.yaml;
#                       edit DATABASE_URL to point at your own Postgres)
#   nats-passwords.env  one NATS_PASSWORD_* per user in nats/nats.conf
#   catalog-memory.env  CATALOG_MEMORY_KEY, the key the catalog's replicas
#                       seal their shared memory with (at least 32 bytes)
# An existing file is kept: delete it to rotate (then `kubectl apply -k` rolls
# every pod that uses it, since the Secret's name carries a hash of its content).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here}"
# URL-safe: NATS passwords go into NATS_URL, Postgres's into DATABASE_URL.
# A letter first: nats-server parses an env value it substitutes as a config
# value, and one that starts with a digit is taken for a number and refused.
random() { printf 'p'; od -An -N24 -tx1 /dev/urandom | tr -d ' \n'; }

if [[ -e "$out/database.env" ]]; then
    echo "keeping $out/database.env" >&2
else
    password="$(random)"
    umask 077
    printf 'POSTGRES_PASSWORD=%s\nDATABASE_URL=postgres://ctxsync:%s@postgres:5432/ctxsync\n' \
        "$password" "$password" > "$out/database.env"
    echo "wrote $out/database.env" >&2
fi

if [[ -e "$out/nats-passwords.env" ]]; then
    echo "keeping $out/nats-passwords.env" >&2
else
    umask 077
    variables="$(grep -oE '\$NATS_PASSWORD_[A-Z0-9_]+' "$here/nats/nats.conf" | tr -d '$' | sort -u)"
    [[ -n "$variables" ]] || { echo "no \$NATS_PASSWORD_* in $here/nats/nats.conf" >&2; exit 1; }
    for variable in $variables; do
        printf '%s=%s\n' "$variable" "$(random)"
    done > "$out/nats-passwords.env"
    echo "wrote $out/nats-passwords.env" >&2
fi

if [[ -e "$out/catalog-memory.env" ]]; then
    echo "keeping $out/catalog-memory.env" >&2
else
    umask 077
    printf 'CATALOG_MEMORY_KEY=%s\n' "$(random)" > "$out/catalog-memory.env"
    echo "wrote $out/catalog-memory.env" >&2
fi
