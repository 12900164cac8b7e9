#!/usr/bin/env bash
# Installs schemathesis, pinned with every dependency (requirements.txt), into
# a venv at ${CTXSYNC_SCHEMATHESIS_DIR:-$HOME/.cache/ctxsync/schemathesis}
# for tests/e2e/tests/schemathesis.rs. Idempotent: a stamp holding the hash
# of the pins makes a second run a no-op.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="${CTXSYNC_SCHEMATHESIS_DIR:-$HOME/.cache/ctxsync/schemathesis}"
mkdir -p "$dest"

want="$(sha256sum "$here/requirements.txt" | cut -d' ' -f1)"
stamp="$dest/.installed"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" || ! -x "$dest/venv/bin/schemathesis" ]]; then
    echo "installing schemathesis into $dest/venv" >&2
    rm -rf "$dest/venv"
    python3 -m venv "$dest/venv"
    "$dest/venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -r "$here/requirements.txt"
    "$dest/venv/bin/pip" check >/dev/null
    echo "$want" >"$stamp"
fi

# Fail loudly if the tool the test runs is not there.
"$dest/venv/bin/schemathesis" --version >/dev/null || { echo "missing $dest/venv/bin/schemathesis" >&2; exit 1; }
echo "schemathesis ready: $("$dest/venv/bin/schemathesis" --version) in $dest/venv" >&2
