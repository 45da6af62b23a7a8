#!/usr/bin/env bash
# System packages the tests need (`scripts/test-setup.sh`), or only what `make run` needs
# (`scripts/test-setup.sh run`); each step is idempotent and quiet when already done.
# bubblewrap: LocalSandbox isolation. docker.io: DockerSandbox tests (tests start their own dockerd).
# busybox-static: the tiny registry-free test image (scripts/docker-image.sh). util-linux gives setpriv.
set -euo pipefail
need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
if [ "${1:-}" != run ]; then
command -v dockerd >/dev/null || need+=(docker.io)
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || need+=(busybox-static)
command -v setpriv >/dev/null || need+=(util-linux)
# docker-compose: tests/test_compose.py runs `config` on docker-compose.yml (the plugin does too, if present).
docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || need+=(docker-compose)
# chromium: the dashboard's browser tests (Playwright drives Debian's build at /usr/bin/chromium).
[ -x /usr/bin/chromium ] || need+=(chromium)
fi
if ((${#need[@]})); then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "test-setup: missing ${need[*]} and not root; what needs them skips (sandboxes run without isolation)" >&2
    fi
fi
