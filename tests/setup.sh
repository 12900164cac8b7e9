#!/usr/bin/env bash
# Prepares a machine to run the test suite: checks (and on Debian installs)
# nats-server and PostgreSQL, starts Postgres if it is installed but stopped,
# installs the reference MCP servers, Chromium and playwright-core for the
# context page's browser tests, schemathesis for the API fuzz test, and
# makes a Docker engine and the local images of the compose test available.
# Safe to run again.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# --demo-only: what `ctxsync up --demo` needs, without the test suite's
# deployment validators and Docker images.
demo_only=false
[[ "${1:-}" == "--demo-only" ]] && demo_only=true
pg_url="${CTXSYNC_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"

apt_install() {
    if command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
        echo "installing $* with apt-get" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
    else
        echo "missing: $*; install it (Debian: apt-get install $*)" >&2
        exit 1
    fi
}

command -v nats-server >/dev/null || apt_install nats-server
command -v psql >/dev/null || apt_install postgresql postgresql-client
command -v npm >/dev/null || apt_install nodejs npm
command -v python3 >/dev/null || apt_install python3 python3-venv
# The chaos run's network faults (tc netem, nftables in a namespace of its
# own) and clock skew (libfaketime preloaded into a service process).
command -v tc >/dev/null || apt_install iproute2
command -v nft >/dev/null || apt_install nftables
command -v faketime >/dev/null || apt_install faketime

if ! psql "$pg_url" -qtAc 'select 1' >/dev/null 2>&1; then
    if command -v pg_ctlcluster >/dev/null && ls /etc/postgresql/*/main >/dev/null 2>&1; then
        version="$(ls /etc/postgresql | sort -V | tail -1)"
        echo "starting PostgreSQL $version" >&2
        pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    fi
    for _ in $(seq 1 50); do
        psql "$pg_url" -qtAc 'select 1' >/dev/null 2>&1 && break
        sleep 0.2
    done
    psql "$pg_url" -qtAc 'select 1' >/dev/null || {
        echo "PostgreSQL does not answer at $pg_url: start it, or set CTXSYNC_TEST_DATABASE_URL to a superuser URL" >&2
        exit 1
    }
fi

bash "$here/mcp-servers/install.sh"
if ! $demo_only; then
    bash "$here/browser/install.sh"
    bash "$here/schemathesis/install.sh"
    bash "$here/deploy/install-tools.sh"
    bash "$here/docker/setup.sh"
fi
echo "test prerequisites ready" >&2
