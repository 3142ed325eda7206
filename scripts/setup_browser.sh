#!/usr/bin/env bash
# Install the browser of the real-browser test tier (tests/browser): Debian's chromium + chromium-driver.
#
#   bash scripts/setup_browser.sh     # idempotent: returns at once when both are on PATH
#
# Needs apt-get and root (CI containers, this project's machines). Exits non-zero when the browser
# cannot be installed; tests/browser then fails when VRAMFIT_REQUIRE_BROWSER is set, else skips.
# The selenium client comes from PyPI with the dev extra of pyproject.toml (scripts/test.sh).
set -euo pipefail

log() { echo "[vramfit-browser] $*" >&2; }

have_browser() {
  command -v chromedriver >/dev/null 2>&1 && { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }
}

if have_browser; then
  log "chromium and chromedriver present ($(chromium --version 2>/dev/null || chromium-browser --version 2>/dev/null))"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  log "no apt-get here: install chromium and chromedriver yourself"; exit 1
fi
SUDO=""
if [[ "$(id -u)" != 0 ]]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"
  else log "not root and no password-less sudo: cannot apt-get install chromium"; exit 1; fi
fi
log "installing chromium chromium-driver with apt-get"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >&2
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-dejavu-core >&2
have_browser || { log "chromium/chromedriver still missing after apt-get"; exit 1; }
log "installed: $(chromium --version 2>/dev/null)"
