#!/usr/bin/env bash
# README command (i): set up a real ComfyUI with this pack and run the example workflow headless.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_host.sh"
# shellcheck disable=SC1091
source "${VRAMFIT_CACHE:-$ROOT/.cache}/host.env"
cd "$ROOT"
exec "$VRAMFIT_PYTHON" -m scripts.demo "$@"
