#!/usr/bin/env bash
# Makes a Docker engine available and builds the local images the compose
# test runs on. There is no registry here, so nothing is pulled:
#   ctxsync-local/debian:bookworm   a minimal Debian root filesystem made with
#                                   debootstrap from this machine's own apt
#                                   mirror, turned into an image with
#                                   `docker import`
#   ctxsync-local/nats:2.9          nats-server from Debian's packages
#   ctxsync-local/postgres:15       PostgreSQL from Debian's packages, with
#                                   the official image's POSTGRES_* variables
# Each image is built once and reused (delete it to rebuild). Safe to run
# again. Users elsewhere keep the official nats and postgres images: the
# compose file only defaults to them.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${CTXSYNC_CACHE_DIR:-$HOME/.cache/ctxsync}/docker"
suite=bookworm
base_image="ctxsync-local/debian:$suite"

say() { echo "docker setup: $*" >&2; }

apt_install() {
    if command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
        say "installing $* with apt-get"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
    else
        say "missing: $*; install it (Debian: apt-get install $*)"
        exit 1
    fi
}

command -v dockerd >/dev/null || apt_install docker.io
command -v docker-compose >/dev/null || apt_install docker-compose
command -v debootstrap >/dev/null || apt_install debootstrap

# The engine: started here when nothing answers (as root, logging to a file).
if ! docker info >/dev/null 2>&1; then
    [[ "$(id -u)" == 0 ]] || { say "the Docker engine is not running and this is not root: start dockerd"; exit 1; }
    mkdir -p "$cache"
    say "starting dockerd (log: $cache/dockerd.log)"
    nohup dockerd >"$cache/dockerd.log" 2>&1 &
    for _ in $(seq 1 100); do
        docker info >/dev/null 2>&1 && break
        sleep 0.2
    done
    docker info >/dev/null 2>&1 || { say "dockerd did not start; see $cache/dockerd.log"; tail -20 "$cache/dockerd.log" >&2; exit 1; }
fi

has_image() { docker image inspect "$1" >/dev/null 2>&1; }

# The Debian mirror this machine's apt uses (deb822 or one-line sources).
mirror() {
    local uri
    uri="$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -1 || true)"
    if [[ -z "$uri" ]]; then
        uri="$(grep -h '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | grep -v security | head -1 || true)"
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

if ! has_image "$base_image"; then
    mkdir -p "$cache"
    tarball="$cache/$suite-minbase.tar"
    if [[ ! -s "$tarball" ]]; then
        root="$(mktemp -d)"
        trap 'rm -rf "$root"' EXIT
        say "debootstrap --variant=minbase $suite from $(mirror) (a few minutes, once)"
        debootstrap --variant=minbase "$suite" "$root" "$(mirror)" >"$cache/debootstrap.log" 2>&1 \
            || { say "debootstrap failed; see $cache/debootstrap.log"; tail -20 "$cache/debootstrap.log" >&2; exit 1; }
        # Keep images small: no apt lists or caches in the base.
        rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
        tar -C "$root" -cf "$tarball.partial" .
        mv "$tarball.partial" "$tarball"
        rm -rf "$root"
        trap - EXIT
    fi
    say "importing $base_image"
    docker import --change 'CMD ["/bin/bash"]' "$tarball" "$base_image" >/dev/null
fi

build_local() {
    local image="$1" dir="$2"
    if ! has_image "$image"; then
        say "building $image"
        DOCKER_BUILDKIT=0 docker build -q --build-arg "BASE_IMAGE=$base_image" -t "$image" "$dir" >/dev/null
    fi
}
build_local ctxsync-local/nats:2.9 "$here/images/nats"
build_local ctxsync-local/postgres:15 "$here/images/postgres"
say "ready: $(docker version --format '{{.Server.Version}}') engine, images $base_image, ctxsync-local/nats:2.9, ctxsync-local/postgres:15"
