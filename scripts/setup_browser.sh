#!/usr/bin/env bash
# Install what the real-browser test tier (tests/browser) needs beyond the host: Debian's chromium +
# chromium-driver, and the newest ComfyUI web frontend (the hosts pin older ones: 0.3.75 1.32.9, 0.33.0 1.49.6).
#
#   bash scripts/setup_browser.sh            # both; idempotent: returns at once when both are there
#   bash scripts/setup_browser.sh frontend   # the frontend only; prints its static folder (the server's
#                                            # --front-end-root) as the only line on stdout
#
# chromium needs apt-get and root (CI containers, this project's machines). The frontend is
# comfyui-frontend-package $NEWEST_FRONTEND from PyPI, installed with pip --target into
# <cache>/frontends/<version>/ (VRAMFIT_CACHE, default <repo>/.cache) by VRAMFIT_PYTHON (default python3);
# it is static files only. Exits non-zero when either cannot be installed; tests/browser then fails when
# VRAMFIT_REQUIRE_BROWSER is set, else skips. The selenium client comes from PyPI with the dev extra of
# pyproject.toml (scripts/test.sh).
set -euo pipefail

NEWEST_FRONTEND="1.58.1"  # the newest comfyui-frontend-package on PyPI (2026-11-27); raise it when a newer one installs
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${VRAMFIT_CACHE:-$ROOT/.cache}"

log() { echo "[vramfit-browser] $*" >&2; }

install_frontend() {
  local dir="$CACHE/frontends/$NEWEST_FRONTEND" static
  static="$dir/comfyui_frontend_package/static"
  if [[ ! -f "$static/index.html" ]]; then
    log "installing comfyui-frontend-package==$NEWEST_FRONTEND into $dir"
    rm -rf "$dir.partial"
    "${VRAMFIT_PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --no-deps \
      --target "$dir.partial" "comfyui-frontend-package==$NEWEST_FRONTEND" >&2
    rm -rf "$dir"; mv "$dir.partial" "$dir"
    [[ -f "$static/index.html" ]] || { log "no $static/index.html after installing"; return 1; }
  fi
  echo "$static"
}

if [[ "${1:-}" == frontend ]]; then
  install_frontend
  exit 0
fi
[[ $# -eq 0 ]] || { log "usage: setup_browser.sh [frontend]"; exit 2; }
install_frontend >/dev/null

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
