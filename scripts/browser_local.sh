#!/usr/bin/env bash
# Debian's chromium and chromium-driver for shardtune's browser tests (tests/e2e/test_web_page.py) and for the
# screenshots in docs/. Needs root to install; exit 3 when they are missing and cannot be installed.
#
#   scripts/browser_local.sh install   install when missing; print the paths of the browser and its driver
set -euo pipefail

have() { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }

install() {
    if ! have; then
        if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
            echo "browser_local.sh: chromium and chromium-driver are not installed and cannot be here (needs root and apt-get)" >&2
            return 3
        fi
        export DEBIAN_FRONTEND=noninteractive
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; } || {
            echo "browser_local.sh: apt-get install chromium chromium-driver failed" >&2
            return 3
        }
    fi
    echo "$(command -v chromium) $(command -v chromedriver)"
}

case "${1:-}" in
    install) install ;;
    *) echo "usage: $0 install" >&2; exit 2 ;;
esac
