#!/usr/bin/env bash
# Installs what the browser tests need: Debian's chromium (apt, only if
# missing) and playwright-core pinned by package.json + package-lock.json,
# into ${CTXSYNC_BROWSER_DIR:-$HOME/.cache/ctxsync/browser}. Idempotent.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="${CTXSYNC_BROWSER_DIR:-$HOME/.cache/ctxsync/browser}"
mkdir -p "$dest"

if ! command -v chromium >/dev/null; then
    if command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
        echo "installing chromium with apt-get" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "missing: chromium; install it (Debian: apt-get install chromium)" >&2
        exit 1
    fi
fi

want="$(cat "$here/package.json" "$here/package-lock.json" | sha256sum | cut -d' ' -f1)"
stamp="$dest/.installed"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    echo "installing playwright-core into $dest" >&2
    cp "$here/package.json" "$here/package-lock.json" "$dest/"
    (cd "$dest" && npm ci --no-audit --no-fund --loglevel=error)
    echo "$want" >"$stamp"
fi
[[ -f "$dest/node_modules/playwright-core/package.json" ]] || { echo "missing $dest/node_modules/playwright-core" >&2; exit 1; }
echo "browser test tools ready: $(command -v chromium), playwright-core in $dest" >&2
