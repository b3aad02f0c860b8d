#!/usr/bin/env bash
# Installs Debian's chromium and chromium-driver for the chat page's browser test when they are
# missing (apt-get, as root or through sudo without a password). Exits 1, saying why, when they
# are missing and cannot be installed.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "chromium is not installed and there is no apt-get to install it" >&2
    exit 1
fi
if [ "$(id -u)" = 0 ]; then
    as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "chromium is not installed and apt-get needs root (or sudo without a password)" >&2
    exit 1
fi
echo "installing chromium and chromium-driver (apt-get)" >&2
"${as_root[@]}" apt-get update -qq >&2
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >&2
command -v chromium >/dev/null && command -v chromedriver >/dev/null
