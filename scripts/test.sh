#!/usr/bin/env bash
# README command (ii): the test suite against a real ComfyUI host (installed first; idempotent).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -q`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# COMFYUI_SRC=<tar.gz or folder> tests against that ComfyUI source tree, COMFYUI_PATH=<folder> against
# an existing install (see scripts/setup_host.sh); default: ComfyUI 0.3.75.
HOST_ENV="$(bash "$ROOT/scripts/setup_host.sh")"
# Exported, so pytest (scripts/host.py) and the servers it starts use exactly this host.
set -a
# shellcheck disable=SC1090
source "$HOST_ENV"
set +a
echo "[vramfit-test] ComfyUI $VRAMFIT_HOST_VERSION at $COMFYUI_PATH" >&2
cd "$ROOT"
# The dev extra of pyproject.toml (pytest, hypothesis, ruff, ...) into the host's python.
"$VRAMFIT_PYTHON" - <<'PY'
import re, subprocess, sys
text = open("pyproject.toml").read()
block = re.search(r"^dev\s*=\s*\[(.*?)\]", text, re.S | re.M).group(1)
reqs = re.findall(r'"([^"]+)"', block)
subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *reqs])
PY
"$VRAMFIT_PYTHON" -m ruff check .
bash "$ROOT/scripts/setup_browser.sh" || echo "[vramfit-test] no chromium: tests/browser skip (fail if VRAMFIT_REQUIRE_BROWSER is set)" >&2
set +e
"$VRAMFIT_PYTHON" -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit $rc
