#!/usr/bin/env bash
# Installs the tools the deploy-checks tests (tests/deploy) run into
# ${CTXSYNC_TOOLS_DIR:-$HOME/.cache/ctxsync/tools}/bin:
#   kubernetes-validate, check-jsonschema  PyPI, pinned, in a venv
#   kubectl (for `kubectl kustomize`)       Debian's kubernetes-client, unpacked (no root needed)
# nats-server comes from tests/setup.sh. Safe to run again.
set -euo pipefail

tools="${CTXSYNC_TOOLS_DIR:-$HOME/.cache/ctxsync/tools}"
pins="kubernetes-validate==1.37.0 check-jsonschema==0.39.0"
mkdir -p "$tools/bin"

venv="$tools/venv"
if [[ "$(cat "$venv/.ctxsync-pins" 2>/dev/null)" != "$pins" ]]; then
    echo "installing $pins into $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv" || {
        echo "python3 cannot create a venv: install python3-venv (Debian: apt-get install python3-venv)" >&2
        exit 1
    }
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q --disable-pip-version-check $pins
    echo "$pins" > "$venv/.ctxsync-pins"
fi
ln -sf "$venv/bin/kubernetes-validate" "$tools/bin/kubernetes-validate"
ln -sf "$venv/bin/check-jsonschema" "$tools/bin/check-jsonschema"

if ! "$tools/bin/kubectl" kustomize --help >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null; then
        echo "missing: kubectl with kustomize (put it at $tools/bin/kubectl)" >&2
        exit 1
    fi
    echo "unpacking Debian's kubernetes-client (kubectl) into $tools" >&2
    download="$(mktemp -d)"
    trap 'rm -rf "$download"' EXIT
    if ! (cd "$download" && apt-get download -qq kubernetes-client >/dev/null 2>&1); then
        [[ "$(id -u)" == 0 ]] && apt-get update -qq >/dev/null
        (cd "$download" && apt-get download -qq kubernetes-client >/dev/null) || {
            echo "cannot download Debian's kubernetes-client: run apt-get update, or put kubectl at $tools/bin/kubectl" >&2
            exit 1
        }
    fi
    rm -rf "$tools/kubernetes-client"
    dpkg -x "$download"/kubernetes-client_*.deb "$tools/kubernetes-client"
    ln -sf "$tools/kubernetes-client/usr/bin/kubectl" "$tools/bin/kubectl"
fi
"$tools/bin/kubectl" kustomize --help >/dev/null
echo "deploy tools ready in $tools/bin" >&2
