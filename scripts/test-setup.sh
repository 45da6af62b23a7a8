#!/usr/bin/env bash
# System packages the tests need; each step is idempotent and quiet when already done.
set -euo pipefail
need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v dockerd >/dev/null || need+=(docker.io)
if ((${#need[@]})); then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "test-setup: missing ${need[*]} and not root; the tests needing them will skip" >&2
    fi
fi
