#!/usr/bin/env bash
# Installs the reference MCP servers the tests run against, and the official
# MCP SDKs the catalog's MCP endpoint tests connect with, pinned:
#   npm  @modelcontextprotocol/server-{everything,filesystem,memory}  (package.json + package-lock.json)
#        @modelcontextprotocol/sdk                                    (TypeScript SDK v1)
#        @modelcontextprotocol/client                                 (TypeScript SDK v2 client, 2026-07-28)
#        @modelcontextprotocol/conformance                            (the official MCP conformance suite)
#   PyPI mcp-server-time, mcp (Python SDK)                            (requirements.txt, fully pinned)
#   npm  node-linux-<arch>                                            (Node 22, which the suite needs)
# into ${CTXSYNC_MCP_SERVERS_DIR:-$HOME/.cache/ctxsync/mcp-servers}.
# Idempotent: a stamp holding the hash of the pin files (and one holding the
# Node 22 package) makes a second run a no-op.
#
# The suite, against a server (add --scenario NAME for one, -o DIR for checks.json files):
#   "$dest/node22/bin/node" "$dest/node_modules/@modelcontextprotocol/conformance/dist/index.js" \
#       server --url http://127.0.0.1:PORT/mcp --suite all
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="${CTXSYNC_MCP_SERVERS_DIR:-$HOME/.cache/ctxsync/mcp-servers}"
mkdir -p "$dest"

pins_hash() {
    cat "$here/package.json" "$here/package-lock.json" "$here/requirements.txt" | sha256sum | cut -d' ' -f1
}
want="$(pins_hash)"

node_stamp="$dest/.node-installed"
if [[ "$(cat "$node_stamp" 2>/dev/null)" != "$want" ]]; then
    echo "installing npm reference servers into $dest" >&2
    cp "$here/package.json" "$here/package-lock.json" "$dest/"
    (cd "$dest" && npm ci --no-audit --no-fund --loglevel=error)
    echo "$want" >"$node_stamp"
fi

py_stamp="$dest/.python-installed"
if [[ "$(cat "$py_stamp" 2>/dev/null)" != "$want" ]]; then
    echo "installing PyPI reference servers into $dest/venv" >&2
    rm -rf "$dest/venv"
    python3 -m venv "$dest/venv"
    "$dest/venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -r "$here/requirements.txt"
    "$dest/venv/bin/pip" check >/dev/null
    echo "$want" >"$py_stamp"
fi

# Node 22 for the conformance suite, which imports fs.globSync (Node >= 22) while
# the machine's node may be older (Debian 12 has none newer than 20): the
# official build as the npm registry ships it, a binary inside the package with
# no install script, so nothing is fetched from anywhere else.
node22_version=22.23.5
case "$(uname -m)" in
    x86_64) node22_arch=x64 ;;
    aarch64 | arm64) node22_arch=arm64 ;;
    *) echo "no Node 22 package for $(uname -m)" >&2; exit 1 ;;
esac
node22_pkg="node-linux-$node22_arch@$node22_version"
node22_stamp="$dest/.node22-installed"
if [[ "$(cat "$node22_stamp" 2>/dev/null)" != "$node22_pkg" ]]; then
    echo "installing Node $node22_version ($node22_pkg) into $dest/node22" >&2
    rm -rf "$dest/node22"
    mkdir -p "$dest/node22/bin"
    npm install --prefix "$dest/node22" --save-exact --no-audit --no-fund --loglevel=error "$node22_pkg"
    ln -s "../node_modules/node-linux-$node22_arch/bin/node" "$dest/node22/bin/node"
    echo "$node22_pkg" >"$node22_stamp"
fi

# Fail loudly if anything the tests look for is missing.
for bin in mcp-server-everything mcp-server-filesystem mcp-server-memory; do
    [[ -x "$dest/node_modules/.bin/$bin" ]] || { echo "missing $dest/node_modules/.bin/$bin" >&2; exit 1; }
done
[[ -x "$dest/venv/bin/mcp-server-time" ]] || { echo "missing $dest/venv/bin/mcp-server-time" >&2; exit 1; }
[[ -f "$dest/node_modules/@modelcontextprotocol/sdk/package.json" ]] || { echo "missing the TypeScript MCP SDK in $dest/node_modules" >&2; exit 1; }
[[ -f "$dest/node_modules/@modelcontextprotocol/client/package.json" ]] || { echo "missing the TypeScript MCP SDK v2 client in $dest/node_modules" >&2; exit 1; }
"$dest/venv/bin/python" -c 'import mcp.client.streamable_http' || { echo "missing the Python MCP SDK in $dest/venv" >&2; exit 1; }
[[ "$("$dest/node22/bin/node" --version)" == "v$node22_version" ]] || { echo "missing Node $node22_version in $dest/node22" >&2; exit 1; }
"$dest/node22/bin/node" "$dest/node_modules/@modelcontextprotocol/conformance/dist/index.js" --version >/dev/null \
    || { echo "the MCP conformance suite in $dest/node_modules does not start on $dest/node22/bin/node" >&2; exit 1; }
echo "reference MCP servers ready in $dest" >&2
