#!/usr/bin/env bash
# Build the registry-free DockerSandbox test image from Debian's static busybox:
#   scripts/docker-image.sh [TAG] [DOCKER_HOST]
# The image holds /bin/busybox, one symlink per applet, /bin/sh, /tmp and /work, and nothing else.
# Idempotent: does nothing when TAG already exists.
set -euo pipefail
tag="${1:-corral-sandbox:test}"
if [ -n "${2:-}" ]; then export DOCKER_HOST="$2"; fi
if docker image inspect "$tag" >/dev/null 2>&1; then exit 0; fi
busybox="$(command -v busybox || true)"
if [ -z "$busybox" ] || [[ "$(ldd "$busybox" 2>&1 || true)" != *"not a dynamic"* ]]; then
    echo "docker-image: need a static busybox (apt-get install busybox-static)" >&2
    exit 1
fi
rootfs="$(mktemp -d)"
trap 'rm -rf "$rootfs"' EXIT
mkdir -p "$rootfs"/{bin,tmp,work,proc,sys,dev,etc}
chmod 1777 "$rootfs/tmp"
cp "$busybox" "$rootfs/bin/busybox"
for applet in $("$busybox" --list); do
    [ "$applet" = busybox ] || ln -sf busybox "$rootfs/bin/$applet"
done
echo 'root:x:0:0:root:/root:/bin/sh' >"$rootfs/etc/passwd"
echo 'root:x:0:' >"$rootfs/etc/group"
tar -C "$rootfs" -c . | docker import -c 'ENV PATH=/bin' -c 'WORKDIR /work' - "$tag" >/dev/null
echo "docker-image: imported $tag"
